"""Qwen3-ASR against transformers running the model's own processor, on a tiny random checkpoint: log-mel features,
resampling, decoding and limits, encoder embeddings, greedy transcriptions, a batch, a session, the prefix cache,
and a TensorRT-RTX build of audio.onnx."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from tiny_qwen3_asr import MELS, RATE, make_tiny_qwen3_asr, reference_processor, speech_like

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (seconds, seed): under the 0.5 s minimum, one partial chunk, windows of 2 chunks cut mid-window, several windows
CLIPS = [(0.3, 0), (1.0, 1), (2.37, 2), (4.5, 3), (7.91, 4)]


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("qwen3_asr")
    hf = make_tiny_qwen3_asr(root / "hf")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf)
    llm.close()


def _float64_extractor(fe, x: np.ndarray) -> np.ndarray:
    """transformers' Qwen3ASRFeatureExtractor transform (its own filters) evaluated in float64: the exact values
    its float32 STFT rounds."""
    w = torch.from_numpy(np.asarray(x, np.float64))
    stft = torch.stft(w, fe.n_fft, fe.hop_length, window=torch.hann_window(fe.n_fft, dtype=torch.float64),
                      return_complex=True)
    mel = torch.from_numpy(fe.mel_filters.astype(np.float32).astype(np.float64)).T @ (stft[..., :-1].abs() ** 2)
    log = torch.clamp(mel, min=1e-10).log10()
    return ((torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0).numpy()


@pytest.mark.parametrize("mels", [MELS, 128])
def test_log_mel_equals_the_feature_extractor(mels):
    """Features of speech-like clips (and silence, and 30 s padding) equal Qwen3ASRFeatureExtractor's as its
    processor calls it: shapes, valid frames (the attention mask), values. Against the extractor's transform in
    float64 within 1e-6; against its float32 STFT within 1e-4 (that STFT's own rounding, up to ~7e-5 here)."""
    from decodert.runtime.audio.features import MelSettings, log_mel

    fe = transformers.Qwen3ASRFeatureExtractor(feature_size=mels)
    s = MelSettings(n_mels=mels, min_samples=8000, frame_multiple=100)
    clips = [speech_like(sec, seed) for sec, seed in CLIPS] + [np.zeros(RATE * 3 // 2, np.float32)]
    for x in clips:
        ref = fe(x, sampling_rate=RATE, padding=True, truncation=False, return_tensors="np", return_attention_mask=True)
        mel, valid = log_mel(x, s)
        assert mel.shape == ref["input_features"][0].shape and valid == int(ref["attention_mask"][0].sum())
        np.testing.assert_allclose(mel, ref["input_features"][0], atol=1e-4, rtol=0)
        padded = np.pad(x, (0, max(0, 8000 - x.size)))
        exact = _float64_extractor(fe, padded)
        np.testing.assert_allclose(mel[:, :exact.shape[1]], exact, atol=1e-6, rtol=0)
        assert not mel[:, exact.shape[1]:].any()  # frames padded to the chunk are zeros
    x = speech_like(3.3, 5)  # the extractor's own default: padding="max_length" to 30 s
    ref = fe(x, sampling_rate=RATE, return_tensors="np", return_attention_mask=True)
    mel, valid = log_mel(x, s, pad_to=30 * RATE)
    assert mel.shape == ref["input_features"][0].shape and valid == int(ref["attention_mask"][0].sum())
    np.testing.assert_allclose(mel, ref["input_features"][0], atol=1e-4, rtol=0)


def test_resample_poly_equals_scipy():
    scipy_signal = pytest.importorskip("scipy.signal")
    from decodert.runtime.audio.clips import resample_poly

    x = np.random.default_rng(0).standard_normal(2 * 44100 + 17)
    for rate in (8000, 22050, 44100, 48000, 11025):
        want = scipy_signal.resample_poly(x[: 2 * rate + 13], RATE, rate)
        got = resample_poly(x[: 2 * rate + 13], RATE, rate)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


def test_wav_and_flac_decode_downmix_and_resample():
    soundfile = pytest.importorskip("soundfile")
    from decodert.runtime.audio.clips import DEFAULT_AUDIO_LIMITS, load_audio, resample_poly

    rng = np.random.default_rng(1)
    stereo = (0.3 * rng.standard_normal((44100, 2))).astype(np.float32)
    for fmt, subtype, tol in (("WAV", "FLOAT", 1e-7), ("FLAC", "PCM_24", 1e-6)):
        buf = io.BytesIO()
        soundfile.write(buf, stereo, 44100, format=fmt, subtype=subtype)
        got = load_audio(buf.getvalue(), "clip", DEFAULT_AUDIO_LIMITS, RATE)
        decoded = soundfile.read(io.BytesIO(buf.getvalue()), dtype="float32")[0]
        want = resample_poly(decoded.astype(np.float64).mean(axis=1), RATE, 44100)
        assert got.dtype == np.float32 and got.shape == (16000,)
        np.testing.assert_allclose(got, want, atol=tol)
    pcm = (rng.integers(-2 ** 15, 2 ** 15, 16000)).astype(np.int16)  # integer samples -> [-1, 1)
    np.testing.assert_allclose(load_audio((pcm, RATE), "clip", DEFAULT_AUDIO_LIMITS, RATE), pcm / 32768.0, atol=1e-7)


@pytest.mark.parametrize("source, kw, message", [
    (b"RIFF not really a wav file at all", {}, "not a readable audio file"),
    (np.zeros(16000, np.float32), {}, "needs its sample_rate"),
    ((np.zeros(RATE * 11, np.float32), RATE), {"max_seconds": 10.0}, "the limit is 10 s"),
    (b"x" * 2048, {"max_bytes": 1024}, "the limit is 1024"),
    ("/no/such/clip.wav", {}, "no audio file"),
    ("data:audio/wav;base64,@@@", {}, "not valid base64"),
    ((np.full(100, np.nan, np.float32), RATE), {}, "NaN"),
])
def test_bad_audio_is_one_line(source, kw, message):
    from decodert.errors import DecodertError
    from decodert.runtime.audio.clips import AudioLimits, load_audio

    with pytest.raises(DecodertError, match=message) as e:
        load_audio(source, "clip", AudioLimits(**kw), RATE)
    assert "\n" not in str(e.value)


def test_audio_embeddings_equal_the_audio_tower(asr):
    """audio.onnx rows within 1e-4 of get_audio_features (the tower and projector) on the extractor's features."""
    llm, model, processor = asr
    for sec, seed in CLIPS:
        x = speech_like(sec, seed)
        f = processor.feature_extractor(x, sampling_rate=RATE, padding=True, return_tensors="pt",
                                        return_attention_mask=True)
        with torch.no_grad():
            want = model.get_audio_features(f["input_features"], f["attention_mask"]).pooler_output.numpy()
        got = llm.audio.embeddings(x)
        assert got.shape == want.shape == (llm.audio.spec.tokens(int(f["attention_mask"].sum())), 64)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _reference(processor, model, x, language=None, prompt=None, n=12):
    inputs = processor.apply_transcription_request(x, language=language, prompt=prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    return inputs, out.tolist()


@pytest.mark.parametrize("language, prompt", [(None, None), ("en", None), ("Chinese", "names: Ada, Bo")])
def test_transcribe_gives_transformers_greedy_tokens(asr, language, prompt):
    """LLM.transcribe builds apply_transcription_request's prompt (ids equal) and generates its greedy tokens for
    clips of every length and silence; the text is the processor's transcription (runtime/audio/transcribe.py)."""
    llm, model, processor = asr
    clips = [speech_like(sec, seed) for sec, seed in CLIPS] + [np.zeros(RATE, np.float32)]
    for x in clips:
        inputs, want = _reference(processor, model, x, language, prompt)
        got = llm.transcribe(x, sample_rate=RATE, language=language, prompt=prompt, max_new_tokens=12, temperature=0)
        assert got.token_ids[:len(want)] == want
        assert got.text == _text(processor, want)


def _text(processor, ids) -> str:
    """The processor's transcription of ``ids``, less a trailing incomplete UTF-8 character (transformers decodes
    it to U+FFFD; the incremental detokenizer holds its bytes back when generation stops inside it)."""
    return processor.decode(ids, return_format="transcription_only").rstrip("\ufffd").strip()


def test_prompt_ids_equal_the_processor(asr):
    from decodert.runtime.vision.tokens import text_ids

    llm, model, processor = asr
    x = speech_like(2.37, 2)
    inputs = processor.apply_transcription_request(x, language="en")
    rate = llm.audio.sampling_rate
    from decodert.runtime.audio.transcribe import transcription_messages

    messages, prefill = transcription_messages(x, rate, "en")
    messages, clips = llm.split_audio(messages)
    ids = llm.prompt_ids(llm.apply_chat_template(messages) + prefill, (), clips)
    assert text_ids(ids).tolist() == inputs["input_ids"][0].tolist()


def _ask(x, text="Transcribe it."):
    import base64

    buf = io.BytesIO()
    import soundfile

    soundfile.write(buf, x, RATE, format="WAV", subtype="FLOAT")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def test_chat_with_an_input_audio_part_equals_transformers(asr):
    """An OpenAI input_audio part (base64 WAV) in a chat message: transformers' tokens for the same messages."""
    pytest.importorskip("soundfile")
    llm, model, processor = asr
    x = speech_like(2.37, 2)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": x}, {"type": "text", "text": "Transcribe it."}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert llm.chat(_ask(x), max_new_tokens=10, temperature=0).token_ids[:len(want)] == want


def test_a_batch_equals_singles(asr):
    pytest.importorskip("soundfile")
    llm, _, _ = asr
    asks = [_ask(speech_like(0.3, 0)), _ask(speech_like(4.5, 3), "Again?"), [{"role": "user", "content": "Hi"}],
            _ask(np.zeros(RATE, np.float32))]
    _fresh(llm)
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    _fresh(llm)
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles


def _fresh(llm):
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()


def test_a_session_follow_up_equals_a_fresh_chat(asr):
    """A session's second question about a clip prefills only the new turn and equals a full re-prefill."""
    pytest.importorskip("soundfile")
    llm, _, _ = asr
    chat = llm.session()
    first = chat.chat(_ask(speech_like(2.37, 2))[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And the language?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the clip was not prefilled again
    _fresh(llm)
    again = llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0)
    assert second.token_ids == again.token_ids
    chat.close()


@pytest.mark.parametrize("as_array", [False, True])
def test_a_saved_session_with_a_clip_resumes_to_the_same_turn(asr, tmp_path, as_array):
    """Session.save keeps the clip as the model read it (float32 at its rate), whether it came as a base64 WAV or
    as (samples, rate) in the API; LLM.resume's next turn equals the live session's."""
    pytest.importorskip("soundfile")
    llm, _, _ = asr
    x = speech_like(2.37, 2)
    message = ({"role": "user", "content": [{"type": "audio", "audio": (x, RATE)}, {"type": "text", "text": "Hi"}]}
               if as_array else _ask(x)[0])
    live = llm.session()
    live.chat(message, max_new_tokens=4, temperature=0)
    live.save(tmp_path / "clip.session")
    want = live.chat("And the language?", max_new_tokens=5, temperature=0)
    live.close()
    _fresh(llm)
    resumed = llm.resume(tmp_path / "clip.session")
    got = resumed.chat("And the language?", max_new_tokens=5, temperature=0)
    assert got.token_ids == want.token_ids and resumed.last_turn.reused_tokens > 0
    resumed.close()


def test_the_prefix_cache_reuses_a_clip(asr):
    pytest.importorskip("soundfile")
    llm, _, _ = asr
    if llm.prefix_cache is None:
        pytest.skip("the prefix cache is off")
    x = speech_like(4.5, 3)
    llm.chat(_ask(x, "What is it?"), max_new_tokens=3, temperature=0)
    again = llm.chat(_ask(x, "What is said?"), max_new_tokens=6, temperature=0)
    assert again.metrics.cached_tokens >= 32  # whole blocks inside the clip's 59 tokens
    other = llm.chat(_ask(speech_like(4.5, 9), "What is said?"), max_new_tokens=6, temperature=0)
    assert other.metrics.cached_tokens < 16  # another clip differs from its first audio token on
    llm.prefix_cache.clear()
    assert llm.chat(_ask(x, "What is said?"), max_new_tokens=6, temperature=0).token_ids == again.token_ids


def test_audio_parts_are_refused_in_one_line(asr):
    from decodert.errors import DecodertError

    llm, _, _ = asr
    bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}]}]
    with pytest.raises(DecodertError, match="format 'aiff' is not one of"):
        llm.chat(bad, max_new_tokens=2)
    with pytest.raises(DecodertError, match="input_audio needs a 'data'"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], max_new_tokens=2)
    with pytest.raises(DecodertError, match="language 'xx' is not one"):
        llm.transcribe(np.zeros(RATE, np.float32), sample_rate=RATE, language="xx")
    with pytest.raises(DecodertError, match="timestamps .segments. are made by Whisper artifacts only"):
        llm.transcribe(np.zeros(RATE, np.float32), sample_rate=RATE, timestamps=True)


@pytest.mark.trt
def test_audio_graph_builds_with_tensorrt_rtx(asr, tmp_path):
    """audio.onnx of the trt target parses and builds with TensorRT-RTX under its profile (clips up to 30 s), beside
    the text engines."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = asr
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    profile = engines["audio"].profile
    assert profile["input_features"]["max"] == [30, MELS, 100] and profile["key_valid"]["max"] == [15, 26]
    assert [t["name"] for t in engines["audio"].io["outputs"]] == ["audio_embeds"]


def _wav(x: np.ndarray, rate: int = RATE) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_openai_client_transcriptions_equal_transformers(asr):
    """client.audio.transcriptions.create against the served tiny model returns transformers' transcription of the
    same clip (json, text, verbose_json; a 44.1 kHz upload is resampled; a forced language)."""
    pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    import soundfile

    from serve_helpers import running

    from decodert.serve.protocols.transcriptions import MAX_TOKENS

    llm, model, processor = asr
    x = speech_like(2.37, 2)
    wav = _wav(x)
    decoded = soundfile.read(io.BytesIO(wav), dtype="float32")[0]  # what the server reads: 16-bit PCM
    _, want = _reference(processor, model, decoded, n=MAX_TOKENS)
    _, want_en = _reference(processor, model, decoded, language="en", n=MAX_TOKENS)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), temperature=0)
        assert got.text == _text(processor, want)
        text = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav), response_format="text",
                                                  language="en")
        assert text == _text(processor, want_en)
        verbose = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav),
                                                     response_format="verbose_json", language="en")
        assert verbose.text == _text(processor, want_en) and verbose.language == "english"
        assert verbose.duration == pytest.approx(2.37, abs=1e-3)


def test_transcription_bad_inputs_are_one_line_400s(asr):
    pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    import httpx

    from serve_helpers import running

    llm, _, _ = asr
    wav = _wav(speech_like(1.0, 1))
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        cases = [({"file": ("a.wav", b"not audio at all")}, {}, "not a readable audio file"),
                 ({"file": ("a.wav", wav)}, {"response_format": "srt"}, "response_format 'srt' needs timestamps"),
                 ({"file": ("a.wav", wav)}, {"response_format": "verbose_json", "timestamp_granularities": ["segment"]},
                  "timestamp_granularities segment needs timestamps"),
                 ({"file": ("a.wav", wav)}, {"language": "xx"}, "language 'xx'")]
        for files, extra, message in cases:
            with pytest.raises(openai.BadRequestError) as e:
                client.audio.transcriptions.create(model="tiny", **files, **extra)
            assert message in e.value.message and "\n" not in e.value.message
        auth = {"Authorization": "Bearer none"}
        r = httpx.post(url + "/v1/audio/transcriptions", data={"model": "tiny"}, files={"other": ("x", b"1")},
                       headers=auth, timeout=30)
        assert r.status_code == 400 and "'file' part" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/audio/transcriptions", data={"model": "tiny"}, files={"file": ("a.wav", wav)},
                       timeout=30)  # curl's way: no auth header, no Origin
        assert r.status_code == 200 and r.json()["text"] == client.audio.transcriptions.create(
            model="tiny", file=("a.wav", wav)).text
        page = {"Origin": "http://evil.example"}  # a web page's cross-origin form post, no preflight
        r = httpx.post(url + "/v1/audio/transcriptions", data={"model": "tiny"}, files={"file": ("a.wav", wav)},
                       headers=page, timeout=30)
        assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"]
        limits, llm.audio_limits = llm.audio_limits, type(llm.audio_limits)(max_seconds=0.5)
        try:
            with pytest.raises(openai.BadRequestError, match="the limit is 0.5 s"):
                client.audio.transcriptions.create(model="tiny", file=("a.wav", wav))
        finally:
            llm.audio_limits = limits


def test_a_model_without_audio_refuses_transcriptions(tiny_checkpoint, tmp_path):
    """A text model answers a one-line 400 on /v1/audio/transcriptions and a DecodertError from transcribe."""
    pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    from serve_helpers import running

    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    export_model(tiny_checkpoint("qwen3"), tmp_path / "art", target="ort", dtype="fp32", max_seq=256, progress=False)
    with LLM.load(tmp_path / "art", backend="ort") as text_llm:
        with pytest.raises(DecodertError, match="takes no audio"):
            text_llm.transcribe(np.zeros(RATE, np.float32), sample_rate=RATE)
        with running(text_llm) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="takes no audio"):
                client.audio.transcriptions.create(model="tiny", file=("a.wav", _wav(speech_like(1.0, 1))))


def test_collapse_repeats_equals_the_processors_clean_up():
    """The loop clean-up of a transcription equals Qwen3ASRProcessor's on texts of repeated pieces around the
    threshold (19, 20, 21 and more repeats)."""
    import random

    from transformers.models.qwen3_asr import processing_qwen3_asr as ref

    from decodert.runtime.audio.transcribe import collapse_repeats

    rng = random.Random(0)
    for _ in range(500):
        alpha = rng.choice(["ab", "abc", "a b", "xyz1"])
        text = "".join("".join(rng.choice(alpha) for _ in range(rng.randint(1, 5))) * rng.choice([1, 2, 19, 20, 21, 30])
                       for _ in range(rng.randint(1, 6)))
        assert collapse_repeats(text) == ref._detect_and_fix_repetitions(text)


def test_chat_completions_take_input_audio_parts(asr):
    """The openai client's chat.completions with an input_audio part answers what LLM.chat does."""
    pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    from serve_helpers import running

    llm, _, _ = asr
    messages = _ask(speech_like(1.0, 1))
    want = llm.chat(messages, max_new_tokens=6, temperature=0).text
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want


def test_cli_audio_flag_transcribes_and_the_repl_attaches_audio(asr, tmp_path, capsys):
    """`run --audio FILE` (no --prompt) prints LLM.transcribe's text; --prompt with --audio and /audio in the REPL
    send the clip with the message; a missing file is one line (argparse's exit 2, the REPL's notice)."""
    pytest.importorskip("soundfile")
    from decodert.cli import build_parser
    from decodert.cli.chat import chat_loop, user_message
    from decodert.cli.generate import answer
    from decodert.cli.run import transcribe

    llm, _, _ = asr
    x = speech_like(1.0, 1)
    path = tmp_path / "clip.wav"
    path.write_bytes(_wav(x))
    decoded = llm.transcribe(path, max_new_tokens=6, temperature=0).text
    args = build_parser().parse_args(["run", "M", "--audio", str(path), "--greedy", "--max-new-tokens", "6"])
    assert transcribe(llm, [a for a in args.image], args) == 0
    assert capsys.readouterr().out.strip() == decoded
    expected = llm.chat([user_message("Hi", args.image)], max_new_tokens=4, temperature=0).text
    args = build_parser().parse_args(["generate", "OUT", "--prompt", "Hi", "--audio", str(path), "--json", "--greedy",
                                      "--max-new-tokens", "4"])
    assert answer(llm, "Hi", [user_message("Hi", args.image)], args) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    lines = iter([f"/audio {path}", "Hi", "/audio nowhere.wav"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["chat", "OUT", "--no-stats", "--greedy", "--max-new-tokens", "4"])
    assert chat_loop(llm, args, read=read, out=out, err=err, banner=False) == 0
    assert out.getvalue().strip() == expected.strip()
    assert "will go with the next message" in err.getvalue() and "'nowhere.wav' is not one" in err.getvalue()
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "M", "--audio", str(tmp_path / "none.wav")])
    assert e.value.code == 2


def test_the_manifest_records_audio_onnx_and_inspect_shows_it(asr):
    """manifest.audio: the graph (listed with its hash), the encoder and the log-mel settings from
    preprocessor_config.json; `decodert inspect` prints the encoder line and the graph."""
    from decodert.export.artifact.inspect import inspect_artifact

    llm, _, _ = asr
    m = llm.manifest
    assert m.audio.graph.file == "audio.onnx" and "audio.onnx" in m.files
    assert m.audio.features["n_mels"] == MELS and m.audio.features["min_samples"] == 8000
    assert m.audio.features["frame_multiple"] == 100 and m.audio.spec["n_window_infer"] == 200
    text = inspect_artifact(Path(m.source.path).parent / "art")  # the fixture's root/hf -> root/art
    assert "audio      2 layers (qwen3_asr)" in text and "audio: audio.onnx" in text


def test_responses_and_messages_take_input_audio_parts(asr):
    """The openai client's responses.create and the anthropic client's messages.create, each with an input_audio
    part (Anthropic has no audio block: decodert takes OpenAI's part there), answer what chat completions does."""
    pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from serve_helpers import running

    llm, _, _ = asr
    messages = _ask(speech_like(1.3, 4), "What is said?")
    audio, text = messages[0]["content"]
    want = llm.chat(messages, max_new_tokens=6, temperature=0).text
    assert want
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = client.responses.create(model="tiny", max_output_tokens=6, temperature=0, input=[
            {"role": "user", "content": [audio, {"type": "input_text", "text": text["text"]}]}])
        assert got.output_text == want
        claude = anthropic.Anthropic(base_url=url, api_key="none")
        reply = claude.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0.0}, messages=[
            {"role": "user", "content": [audio, text]}])
        assert "".join(b.text for b in reply.content if b.type == "text") == want
        bad = {**audio, "input_audio": {"data": "AAAA", "format": "aiff"}}
        with pytest.raises(openai.BadRequestError, match="aiff"):
            client.responses.create(model="tiny", max_output_tokens=2, input=[{"role": "user", "content": [bad]}])
        with pytest.raises(anthropic.BadRequestError, match="aiff"):
            claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [bad]}])
