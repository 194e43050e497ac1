"""Whisper with timestamps against transformers: the step rules against WhisperTimeStampLogitsProcessor and the
window split against WhisperGenerationMixin._retrieve_segment on random inputs, then ids and segments of
``transcribe(timestamps=True)`` against ``generate(return_timestamps=True, return_segments=True)`` on a tiny random
checkpoint with Whisper's 1501 timestamp tokens (short clips, silence, clips over 30 s), a batch, the server's
verbose_json / srt / vtt through the openai client, and one-line refusals.

The tiny model's vocabulary is 310 text and special tokens beside 1501 timestamps, so the timestamps' summed
probability often beats the best text token and a random model does emit timestamps (pairs, single endings, seeks to
a pair); max_initial_timestamp_index 4 caps its first timestamp below where it would go (each rule's planted bug
changes these ids: tested once by hand)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tiny_qwen3_asr import speech_like
from tiny_whisper import RATE, make_tiny_whisper, reference_extractor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = 40
CAP = 4  # max_initial_timestamp_index


@pytest.fixture(scope="module")
def stamped(tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("whisper_ts")
    hf = make_tiny_whisper(root / "hf", timestamps=True, max_initial_timestamp_index=CAP)
    export_model(hf, root / "art", target="ort", dtype="fp32", max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, hf
    llm.close()


def _reference(model, x: np.ndarray, language: str | None, n: int | None = TOKENS):
    """transformers' timestamped generate on a clip (over 30 s: its whole features, as its long-form docs say) ->
    (ids without eos, [(start, end, ids)] of its segments)."""
    fe = reference_extractor()
    long = x.size > 30 * RATE
    extra = dict(truncation=False, padding="longest", return_attention_mask=True) if long else {}
    feats = fe(x, sampling_rate=RATE, return_tensors="pt", **extra)
    kwargs = {"attention_mask": feats["attention_mask"]} if long else {}
    if n is not None:
        kwargs["max_new_tokens"] = n
    with torch.no_grad():
        out = model.generate(feats["input_features"], language=language, return_timestamps=True,
                             return_segments=True, **kwargs)
    ids = out["sequences"][0].tolist()
    while ids and ids[-1] == model.generation_config.eos_token_id:
        ids.pop()
    return ids, [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]


def _segments(result):
    return [(s.start, s.end, s.token_ids) for s in result.segments]


def _same_segments(got, want):
    assert [g[2] for g in got] == [w[2] for w in want]
    np.testing.assert_allclose([g[:2] for g in got], [w[:2] for w in want], rtol=0, atol=1e-9)


def test_the_step_rules_equal_the_logits_processor():
    """TimestampRules.constrain equals WhisperTimeStampLogitsProcessor on random logits and histories (empty, one
    timestamp, pairs, text after timestamps, eos padding; with and without max_initial_timestamp_index), the
    probability-mass rule firing in some rows and not in others."""
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    from decodert.runtime.audio.timestamps import TimestampRules

    rng = np.random.default_rng(50)
    vocab, eos, nots, prompt = 90, 10, 29, [1, 2, 3]
    begin = nots + 1
    fired = kept = 0
    for trial in range(300):
        cap = None if trial % 3 == 0 else int(rng.integers(0, 8))
        config = transformers.GenerationConfig(no_timestamps_token_id=nots, eos_token_id=eos,
                                               max_initial_timestamp_index=cap)
        if cap is None:
            del config.max_initial_timestamp_index
        proc = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))
        rules = TimestampRules(begin, nots, eos, cap)
        n, length = 4, int(rng.integers(0, 7))
        rows = []
        for _ in range(n):
            stamps = sorted(rng.integers(begin, vocab, size=length).tolist())
            rows.append([s if rng.random() < 0.5 else int(rng.integers(0, eos + 1)) for s in stamps])
        logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.3, 4.0)).astype(np.float32)
        want = proc(torch.tensor([prompt + r for r in rows]), torch.from_numpy(logits.copy())).numpy()
        got = logits.copy()
        rules.constrain(got, rows)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
        text_open = np.isfinite(got[:, :begin]).any(axis=1)
        fired += int((~text_open & np.isfinite(got[:, begin:]).any(axis=1)).sum())
        kept += int(text_open.sum())
    assert fired > 50 and kept > 50


def test_the_window_split_equals_transformers_retrieve_segment():
    """timestamps.split equals WhisperGenerationMixin._retrieve_segment (segments' times and ids, the seek's
    advance) on random windows: pairs, a single timestamp at the end, text after the last pair, no pair at all,
    one timestamp only, at random seeks and frame counts."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    from decodert.runtime.audio.timestamps import split

    rng = np.random.default_rng(51)
    begin = 400
    kinds = set()
    for _ in range(400):
        length = int(rng.integers(1, 14))
        stamps = sorted(rng.integers(begin, begin + 1501, size=length).tolist())
        ids = [s if rng.random() < 0.55 else int(rng.integers(0, 300)) for s in stamps]
        seek, frames = int(rng.integers(0, 9000)), int(rng.integers(1, 3001))
        segs, offset = WhisperGenerationMixin._retrieve_segment(
            seek_sequence=torch.tensor(ids), seek_outputs=[None], time_offset=torch.tensor([seek], dtype=torch.float64)
            * 0.02 / 2, timestamp_begin=begin, seek_num_frames=torch.tensor([frames]), time_precision=0.02,
            time_precision_features=0.01, input_stride=2, prev_idx=0, idx=0, return_token_timestamps=False,
            decoder_input_ids=torch.zeros((1, 3), dtype=torch.long))
        pieces, advance = split(ids, begin, seek, frames, 2)
        assert advance == int(offset)
        assert [list(p.token_ids) for p in pieces] == [s["tokens"].tolist() for s in segs]
        np.testing.assert_allclose([(p.start, p.end) for p in pieces],
                                   [(float(s["start"]), float(s["end"])) for s in segs], rtol=0, atol=1e-9)
        kinds.add("seek to a pair" if advance != frames else "whole window")
        kinds.add(f"{len(pieces) > 1} pieces")
    assert kinds == {"seek to a pair", "whole window", "True pieces", "False pieces"}


@pytest.mark.parametrize("language", ["en", None])
def test_timestamped_ids_and_segments_equal_transformers(stamped, language):
    """transcribe(timestamps=True): generate's ids (timestamp tokens included) and segments (start, end, ids) on
    clips of several lengths and silence, the given or detected language; the text leaves the timestamps out; the
    first timestamp of every window is within max_initial_timestamp_index."""
    llm, model, hf = stamped
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    begin = model.generation_config.no_timestamps_token_id + 1
    shapes = set()
    for seconds, seed in [(0.4, 0), (2.0, 1), (7.3, 2), (29.99, 3), (0, 0)]:
        x = speech_like(seconds, seed) if seconds else np.zeros(2 * RATE, np.float32)
        want, segments = _reference(model, x, language)
        got = llm.transcribe(x, sample_rate=RATE, language=language, max_new_tokens=TOKENS, timestamps=True)
        assert got.token_ids == want, (seconds, language)
        _same_segments(_segments(got), segments)
        assert got.text == tok.decode(want, skip_special_tokens=True)
        assert [s.text for s in got.segments] == [tok.decode(s[2], skip_special_tokens=True) for s in segments]
        starts = {}
        for s in got.segments:
            starts.setdefault(s.seek, s.token_ids[0])
        assert all(begin <= t <= begin + CAP for t in starts.values())
        shapes.add(len(got.segments) > 1)
        shapes.add(len(starts) > 1)  # a short clip decoded again from its last pair (transformers does)
    assert shapes == {True}
    assert got.to_dict()["segments"][0]["token_ids"] == got.segments[0].token_ids


@pytest.mark.parametrize("seconds,seed", [(64.0, 7), (45.0, 8)])
def test_long_form_with_timestamps_equals_transformers(stamped, seconds, seed):
    """A clip over 30 s: transformers' sequential long-form generate (return_timestamps=True, return_segments=True):
    the same ids and segments, each window at the seek of the last complete pair before it."""
    llm, model, _ = stamped
    x = speech_like(seconds, seed)
    for language in ("en", None):
        want, segments = _reference(model, x, language)
        got = llm.transcribe(x, sample_rate=RATE, language=language, max_new_tokens=TOKENS, timestamps=True)
        assert got.token_ids == want
        _same_segments(_segments(got), segments)
        seeks = sorted({s.seek for s in got.segments})
        assert len(seeks) >= 2 and any(s % 3000 for s in seeks)  # at least one window began at a pair
    assert max(s.end for s in got.segments) > 30.0


def test_without_max_new_tokens_the_length_is_transformers_default(stamped):
    llm, model, _ = stamped
    x = speech_like(2.0, 1)
    want, segments = _reference(model, x, "en", n=None)
    got = llm.transcribe(x, sample_rate=RATE, language="en", timestamps=True)
    assert got.token_ids == want
    _same_segments(_segments(got), segments)


def test_a_timestamped_batch_equals_singles(stamped):
    """transcribe_many with timestamps over clips of one and of three windows: each clip's seek moves on its own."""
    llm = stamped[0]
    clips = [speech_like(2.0, 1), speech_like(64.0, 7), np.zeros(RATE, np.float32), speech_like(7.3, 2)]
    for language in ("en", None):
        batch = llm.transcribe_many(clips, sample_rate=RATE, language=language, max_new_tokens=12, timestamps=True)
        singles = [llm.transcribe(c, sample_rate=RATE, language=language, max_new_tokens=12, timestamps=True)
                   for c in clips]
        assert [b.token_ids for b in batch] == [s.token_ids for s in singles]
        assert [b.segments for b in batch] == [s.segments for s in singles]


def test_timestamps_off_is_the_no_timestamp_run(stamped):
    """Without timestamps the prompt ends on <|notimestamps|> and no segments come back."""
    llm, model, _ = stamped
    x = speech_like(2.0, 1)
    feats = reference_extractor()(x, sampling_rate=RATE, return_tensors="pt")["input_features"]
    with torch.no_grad():
        want = model.generate(feats, language="en", max_new_tokens=8)[0].tolist()
    got = llm.transcribe(x, sample_rate=RATE, language="en", max_new_tokens=8)
    assert got.segments is None and got.token_ids == [t for t in want if t != model.generation_config.eos_token_id]


def _wav(x: np.ndarray) -> bytes:
    soundfile = pytest.importorskip("soundfile")
    buf = io.BytesIO()
    soundfile.write(buf, x, RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _clock(t: float, mark: str) -> str:
    whole = int(t)
    return f"{whole // 3600:02d}:{whole // 60 % 60:02d}:{whole % 60:02d}{mark}{round((t - whole) * 1000):03d}"


def test_openai_client_segments_srt_and_vtt(stamped):
    """client.audio.transcriptions.create(response_format="verbose_json", timestamp_granularities=["segment"]) returns
    transformers' segments (times, ids, text); srt and vtt are those segments as cues; word timestamps and
    granularities without verbose_json are one-line 400s."""
    openai = pytest.importorskip("openai")
    soundfile = pytest.importorskip("soundfile")
    from serve_helpers import running

    llm, model, hf = stamped
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    wav = _wav(speech_like(7.3, 2))
    decoded = soundfile.read(io.BytesIO(wav), dtype="float32")[0]
    want, segments = _reference(model, decoded, "en", n=None)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        verbose = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                     response_format="verbose_json", timestamp_granularities=["segment"])
        got = [(s.start, s.end, s.tokens) for s in verbose.segments]
        assert [g[2] for g in got] == [s[2] for s in segments] and len(got) > 1
        np.testing.assert_allclose([g[:2] for g in got], [s[:2] for s in segments], rtol=0, atol=1e-6)
        assert [s.text for s in verbose.segments] == [tok.decode(s[2], skip_special_tokens=True) for s in segments]
        assert verbose.text == tok.decode(want, skip_special_tokens=True).strip()
        assert [s.id for s in verbose.segments] == list(range(len(got)))
        plain = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                   response_format="verbose_json")
        assert [s.tokens for s in plain.segments] == [s[2] for s in segments]  # segments are the default
        srt = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                 response_format="srt")
        vtt = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                 response_format="vtt")
        texts = [tok.decode(s[2], skip_special_tokens=True).strip() for s in segments]
        cues = [f"{_clock(s[0], ',')} --> {_clock(s[1], ',')}" for s in segments]
        assert srt.strip() == "\n\n".join(f"{i + 1}\n{c}\n{t}" for i, (c, t) in enumerate(zip(cues, texts))).strip()
        assert vtt.strip() == ("WEBVTT\n\n" + "\n\n".join(f"{c.replace(',', '.')}\n{t}"
                                                            for c, t in zip(cues, texts))).strip()
        for extra, message in ((dict(response_format="verbose_json", timestamp_granularities=["word"]),
                                "word is not supported"),
                               (dict(response_format="json", timestamp_granularities=["segment"]),
                                "needs response_format verbose_json")):
            with pytest.raises(openai.BadRequestError, match=message) as e:
                client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), **extra)
            assert "\n" not in e.value.message


def test_a_model_without_timestamp_tokens_refuses_them(tmp_path):
    """The tiny checkpoint without timestamp tokens: timestamps=True and srt are one-line refusals; verbose_json is
    one segment over the clip; a bad timestamps value is refused too."""
    openai = pytest.importorskip("openai")
    from serve_helpers import running

    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = make_tiny_whisper(tmp_path / "hf")
    export_model(hf, tmp_path / "art", progress=False)
    llm = LLM.load(tmp_path / "art")
    x = speech_like(1.0, 1)
    for value, message in ((True, "has no timestamp tokens"), ("yes", "timestamps must be true or false")):
        with pytest.raises(DecodertError, match=message) as e:
            llm.transcribe(x, sample_rate=RATE, timestamps=value)
        assert "\n" not in str(e.value)
    wav = _wav(x)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no timestamp tokens"):
            client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), response_format="srt")
        verbose = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), response_format="verbose_json")
        assert len(verbose.segments) == 1 and verbose.segments[0].start == 0.0
