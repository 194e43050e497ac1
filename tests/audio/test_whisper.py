"""Whisper (encoder-decoder) against transformers on a tiny random WhisperForConditionalGeneration: log-mel features
against WhisperFeatureExtractor, encoder output, greedy tokens of ``generate`` (given and detected languages,
silence, a clip over 30 s), a batch, the cache's cross K/V rule, LLM.load / transcribe, and one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_qwen3_asr import speech_like
from tiny_whisper import RATE, make_tiny_whisper, reference_extractor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (seconds, seed): under half a second, a few seconds, most of a window, a window less a frame
CLIPS = [(0.4, 0), (2.0, 1), (7.3, 2), (29.99, 3)]
TOKENS = 40


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("whisper")
    hf = make_tiny_whisper(root / "hf")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, hf
    llm.close()


def _clip(seconds: float, seed: int) -> np.ndarray:
    return speech_like(seconds, seed) if seconds else np.zeros(2 * RATE, np.float32)


def _reference(model, features: np.ndarray, language: str | None, n: int = TOKENS) -> list[int]:
    """transformers' greedy ``generate`` on one window of features [M, 3000] -> its ids, <|endoftext|> dropped."""
    with torch.no_grad():
        out = model.generate(torch.from_numpy(features[None]), language=language, max_new_tokens=n)[0].tolist()
    eos = model.generation_config.eos_token_id
    while out and out[-1] == eos:
        out.pop()
    return out


def _float64_extractor(fe, x: np.ndarray) -> np.ndarray:
    """WhisperFeatureExtractor's transform (its own filters) in float64: the values its float32 STFT rounds."""
    w = torch.from_numpy(np.asarray(x, np.float64))
    stft = torch.stft(w, fe.n_fft, fe.hop_length, window=torch.hann_window(fe.n_fft, dtype=torch.float64),
                      return_complex=True)
    mel = torch.from_numpy(fe.mel_filters.astype(np.float64)).T @ (stft[..., :-1].abs() ** 2)
    log = torch.clamp(mel, min=1e-10).log10()
    return ((torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0).numpy()


def test_log_mel_windows_equal_the_feature_extractor(whisper):
    """One window (a clip padded to 30 s, silence too) equals WhisperFeatureExtractor's default call within 1e-4
    (its float32 STFT's rounding: up to ~5e-5 here) and its transform in float64 within 1e-6; a 64 s clip's windows
    are the extractor's whole-clip features (truncation=False, padding="longest") cut every 3000 frames, the last
    zero-padded (transformers' long-form segments)."""
    llm = whisper[0]
    fe = reference_extractor()
    for seconds, seed in CLIPS + [(0, 0)]:
        x = _clip(seconds, seed)
        ref = fe(x, sampling_rate=RATE, return_tensors="np")["input_features"][0]
        got = llm.model.windows(x)
        assert got.shape == (1, *ref.shape)
        np.testing.assert_allclose(got[0], ref, atol=1e-4, rtol=0)
        exact = _float64_extractor(fe, np.pad(x, (0, 30 * RATE - x.size)))
        np.testing.assert_allclose(got[0], exact[:, :3000], atol=1e-6, rtol=0)
    x = speech_like(64.0, 7)
    ref = fe(x, sampling_rate=RATE, return_tensors="np", truncation=False, padding="longest",
             return_attention_mask=True)
    frames = int(ref["attention_mask"][0].sum())
    got = llm.model.windows(x)
    assert got.shape[0] == 3 and frames == 6400
    whole = ref["input_features"][0][:, :frames]
    np.testing.assert_allclose(np.concatenate(list(got), axis=1)[:, :frames], whole, atol=1e-4, rtol=0)
    assert not got[2][:, frames - 6000:].any()


def test_encoder_and_cross_kv_equal_transformers(whisper):
    """encoder.onnx's output within 1e-4 of WhisperEncoder's; its cross K/V [B, H, T, D] equal the decoder's
    projections of it, split into heads."""
    llm, model, _ = whisper
    windows = np.stack([llm.model.windows(_clip(s, seed))[0] for s, seed in CLIPS[:2]])
    outs = llm.model.graphs.encoder.run(None, {"input_features": windows})
    names = [o.name for o in llm.model.graphs.encoder.get_outputs()]
    with torch.no_grad():
        hidden = model.model.encoder(torch.from_numpy(windows)).last_hidden_state
        attn = model.model.decoder.layers[1].encoder_attn
        heads = lambda y: y.reshape(*y.shape[:2], attn.num_heads, -1).transpose(1, 2).numpy()  # noqa: E731 [B, H, T, D]
        k, v = heads(attn.k_proj(hidden)), heads(attn.v_proj(hidden))
    np.testing.assert_allclose(outs[names.index("encoder_hidden")], hidden.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(outs[names.index("cross_key.1")], k, atol=1e-4, rtol=0)
    np.testing.assert_allclose(outs[names.index("cross_value.1")], v, atol=1e-4, rtol=0)


@pytest.mark.parametrize("language", ["en", None])
def test_greedy_tokens_equal_transformers_generate(whisper, language):
    """LLM.transcribe's ids equal WhisperForConditionalGeneration.generate's (its forced prompt, suppress_tokens,
    begin_suppress_tokens; a detected language when none is given) on speech-like clips of several lengths and
    silence; the text is the tokenizer's decode of them without special tokens."""
    llm, model, hf = whisper
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    fe = reference_extractor()
    for seconds, seed in CLIPS + [(0, 0)]:
        x = _clip(seconds, seed)
        want = _reference(model, fe(x, sampling_rate=RATE, return_tensors="np")["input_features"][0], language)
        got = llm.transcribe(x, sample_rate=RATE, language=language, max_new_tokens=TOKENS)
        assert got.token_ids == want, (seconds, language)
        assert got.text == tok.decode(want, skip_special_tokens=True)


def test_without_max_new_tokens_the_length_is_transformers_default(whisper):
    """No max_new_tokens: as many tokens as generate makes by default (generation_config max_length plus the prompt,
    at most max_target_positions)."""
    llm, model, _ = whisper
    x = speech_like(2.0, 1)
    feats = reference_extractor()(x, sampling_rate=RATE, return_tensors="np")["input_features"][0]
    with torch.no_grad():
        want = model.generate(torch.from_numpy(feats[None]), language="en")[0].tolist()
    eos = model.generation_config.eos_token_id
    got = llm.transcribe(x, sample_rate=RATE, language="en")
    assert got.token_ids == [t for t in want if t != eos] and len(want) == model.config.max_target_positions - 4


def test_the_forced_prompt_is_the_generation_configs(whisper):
    llm, model, _ = whisper
    g = model.generation_config
    w = llm.model
    assert w.prompt(w.language_id("en"), None) == [g.decoder_start_token_id, g.lang_to_id["<|en|>"],
                                                   g.task_to_id["transcribe"], g.no_timestamps_token_id]
    assert w.prompt(w.language_id("german"), "translate") == [g.decoder_start_token_id, g.lang_to_id["<|de|>"],
                                                              g.task_to_id["translate"], g.no_timestamps_token_id]
    assert w.prompt(g.lang_to_id["<|de|>"], None, given=False) == [g.decoder_start_token_id, g.lang_to_id["<|de|>"],
                                                                   g.no_timestamps_token_id]


def test_a_clip_over_30_s_is_its_windows_joined(whisper):
    """A 64 s clip: consecutive 30 s windows of transformers' long-form features, each decoded by ``generate`` with
    <|notimestamps|>, their ids joined. (transformers' own long-form generation turns timestamps on past 30 s and
    refuses return_timestamps=False, so it is not the reference for a no-timestamp run.)"""
    llm, model, _ = whisper
    fe = reference_extractor()
    x = speech_like(64.0, 7)
    ref = fe(x, sampling_rate=RATE, return_tensors="np", truncation=False, padding="longest", return_attention_mask=True)
    feats = ref["input_features"][0]
    want: list[int] = []
    for seek in range(0, 6400, 3000):
        part = np.zeros((feats.shape[0], 3000), np.float32)
        piece = feats[:, seek:min(6400, seek + 3000)]
        part[:, :piece.shape[1]] = piece
        want += _reference(model, part, "en")
    got = llm.transcribe(x, sample_rate=RATE, language="en", max_new_tokens=TOKENS)
    assert got.token_ids == want and len(want) > 2 * TOKENS - 5
    with pytest.raises(ValueError, match="timestamp"):
        model.generate(torch.from_numpy(feats[None]), attention_mask=torch.from_numpy(ref["attention_mask"]),
                       language="en", return_timestamps=False, max_new_tokens=4)


def test_a_batch_equals_singles(whisper):
    """transcribe_many over clips of one and of three windows (a batch that shrinks after the first windows)."""
    llm = whisper[0]
    clips = [speech_like(2.0, 1), speech_like(64.0, 7), np.zeros(RATE, np.float32), speech_like(7.3, 2)]
    for language in ("en", None):
        batch = llm.transcribe_many(clips, sample_rate=RATE, language=language, max_new_tokens=12)
        singles = [llm.transcribe(c, sample_rate=RATE, language=language, max_new_tokens=12) for c in clips]
        assert [b.token_ids for b in batch] == [s.token_ids for s in singles]
        assert [b.text for b in batch] == [s.text for s in singles]


def test_cross_kv_rule_of_the_cache():
    """KVCache.use_cross: a row's K/V belong to the window whose cross K/V it holds; another window empties it."""
    from decodert.runtime.backends.kv_cache import KVCache

    cache = KVCache(2, 8, 1, 1, 2, np.float32, cross=[("cross_key.0", (3, 2)), ("cross_value.0", (3, 2))])
    assert cache.cross[0].shape == (2, 3, 2) and cache.cross_tag(0) is None
    assert cache.use_cross(0, b"a") is True
    cache.commit([0], [np.array([5, 6])])
    assert cache.use_cross(0, b"a") is False and cache.lengths[0] == 2  # the same window: the row stays
    cache.reset(0)
    assert cache.cross_tag(0) == b"a"  # the cross K/V depend on the clip, not on the ids
    cache.commit([0], [np.array([7])])
    assert cache.use_cross(0, b"b") is True and cache.lengths[0] == 0  # another window: emptied
    cache.commit([0], [np.array([9])])
    cache.move(0, 1)
    assert cache.cross_tag(1) == b"b" and cache.cross_tag(0) is None and list(cache.held(1)) == [9]


def test_bad_inputs_are_one_line(whisper, tmp_path):
    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model

    llm, _, hf = whisper
    x = speech_like(1.0, 1)
    for kwargs, message in ((dict(language="klingon"), "language 'klingon' is not one this model knows"),
                            (dict(temperature=0.7), "temperature must be 0"),
                            (dict(task="summarise"), "task 'summarise' is not one of"),
                            (dict(max_new_tokens=500), "max_target_positions")):
        with pytest.raises(DecodertError, match=message) as e:
            llm.transcribe(x, sample_rate=RATE, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(DecodertError, match="sample_rate"):
        llm.transcribe(x)
    with pytest.raises(DecodertError, match="transcribes audio"):
        llm.generate("hello")
    with pytest.raises(DecodertError, match="--target ort or trt with --dtype fp32 only"):
        export_model(hf, tmp_path / "portable", target="portable", progress=False)
    with pytest.raises(DecodertError, match="--dtype fp32 only \\(got trt, fp16\\)"):
        export_model(hf, tmp_path / "fp16", target="trt", dtype="fp16", progress=False)
    with pytest.raises(DecodertError, match="--max-seq does not apply to .*an encoder-decoder model"):
        export_model(hf, tmp_path / "seq", max_seq=64, progress=False)


def test_cli_export_writes_the_artifact(whisper, tmp_path, capsys):
    """`decodert export HF -o OUT` prints what it wrote, `decodert inspect OUT` describes it; --kv-dtype int8 is
    refused in one line (exit 2)."""
    from decodert.cli import main

    hf = whisper[2]
    assert main(["export", str(hf), "-o", str(tmp_path / "out")]) == 0
    assert "exported whisper (fp32, 2 + 2 layers, encoder.onnx + decoder.onnx)" in capsys.readouterr().out
    assert (tmp_path / "out" / "seq2seq.json").is_file()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "whisper (encoder-decoder): encoder 2 layers, decoder 2 layers, d_model 32" in shown
    assert "80 mels, n_fft 400, hop 160, 16000 Hz, windows of 30 s" in shown
    assert main(["export", str(hf), "-o", str(tmp_path / "q"), "--kv-dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-dtype does not apply" in err and len(err.splitlines()) == 1


def test_openai_client_transcriptions_of_a_whisper_artifact(whisper):
    """client.audio.transcriptions.create against the served tiny Whisper returns transformers' text (json, text,
    verbose_json); a bad language is a one-line 400."""
    soundfile = pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    import io

    from serve_helpers import running

    llm, model, hf = whisper
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    buf = io.BytesIO()
    soundfile.write(buf, speech_like(2.0, 1), RATE, format="WAV", subtype="PCM_16")
    wav = buf.getvalue()
    decoded = soundfile.read(io.BytesIO(wav), dtype="float32")[0]
    feats = reference_extractor()(decoded, sampling_rate=RATE, return_tensors="np")["input_features"][0]
    want = tok.decode(_reference(model, feats, "en", n=model.generation_config.max_length - 4), skip_special_tokens=True).strip()
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en").text == want
        assert client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                  response_format="text") == want
        verbose = client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="en",
                                                     response_format="verbose_json")
        assert verbose.text == want and verbose.duration == pytest.approx(2.0, abs=1e-3)
        with pytest.raises(openai.BadRequestError, match="klingon"):
            client.audio.transcriptions.create(model="tiny", file=("a.wav", wav), language="klingon")
        for call in (lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}]),
                     lambda: client.completions.create(model="tiny", prompt="hi"),
                     lambda: client.embeddings.create(model="tiny", input="hi"),
                     lambda: client.responses.create(model="tiny", input="hi")):
            with pytest.raises(openai.BadRequestError, match="does not generate from text") as e:
                call()
            assert "\n" not in e.value.message
        import httpx

        r = httpx.post(url + "/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "does not generate from text" in r.text


def test_a_tied_head_and_narrow_heads_equal_transformers(tmp_path):
    """proj_out tied to embed_tokens (what real Whisper checkpoints are) and head_dim 8: the same greedy ids."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = make_tiny_whisper(tmp_path / "hf", seed=3, tie_word_embeddings=True, decoder_attention_heads=4)
    export_model(hf, tmp_path / "art", progress=False)
    llm = LLM.load(tmp_path / "art")
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf).eval()
    fe = reference_extractor()
    for seconds, seed in CLIPS[:2]:
        x = _clip(seconds, seed)
        want = _reference(model, fe(x, sampling_rate=RATE, return_tensors="np")["input_features"][0], "en")
        assert llm.transcribe(x, sample_rate=RATE, language="en", max_new_tokens=TOKENS).token_ids == want


def test_the_artifact_is_checked_and_replaced_as_an_artifact(whisper, tmp_path):
    """Export replaces a seq2seq artifact but not a folder of other files; a damaged file is named at load."""
    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = whisper[2]
    out = tmp_path / "art"
    export_model(hf, out, progress=False)
    export_model(hf, out, max_batch=2, progress=False)  # an artifact: replaced
    assert LLM.load(out).model.max_batch == 2
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(DecodertError, match="is not a decodert artifact"):
        export_model(hf, other, progress=False)
    assert (other / "notes.txt").read_text() == "keep me"
    with open(out / "decoder.onnx", "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(DecodertError, match="decoder.onnx: sha256 does not match"):
        LLM.load(out)


def test_cli_run_audio_prints_the_transcription(whisper, tmp_path, capsys, monkeypatch):
    """`decodert run HF_FOLDER --audio FILE` exports the Whisper checkpoint once into the cache and prints what
    LLM.transcribe gives; the artifact folder itself is taken as it is; --quant int4 is refused in one line."""
    soundfile = pytest.importorskip("soundfile")
    from decodert.cli import main
    from decodert.errors import DecodertError
    from decodert.export.prepare import prepare_model

    llm, _, hf = whisper
    monkeypatch.setenv("DECODERT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "clip.wav"
    soundfile.write(path, speech_like(2.0, 1), RATE, subtype="FLOAT")
    want = llm.transcribe(path, max_new_tokens=6).text
    assert main(["run", str(hf), "--audio", str(path), "--greedy", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    art = prepare_model(hf)
    assert art.parent.parent == tmp_path / "cache" and prepare_model(art) == art and prepare_model(hf) == art
    with pytest.raises(DecodertError, match="--quant and --max-seq do not apply"):
        prepare_model(hf, quant="int4")


class _Counted:
    """An ORT session that counts its runs."""

    def __init__(self, session) -> None:
        self.session, self.calls = session, 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.session.run(*args, **kwargs)

    def get_outputs(self):
        return self.session.get_outputs()


def test_a_repeated_clip_is_not_encoded_again(whisper, monkeypatch):
    """The rows already hold the clip's cross K/V (KVCache.use_cross): the encoder does not run, the ids are the same;
    another clip in the row is encoded."""
    llm = whisper[0]
    x, y = speech_like(2.0, 11), speech_like(2.0, 12)
    first = llm.transcribe(x, sample_rate=RATE, language="en", max_new_tokens=8)
    counted = _Counted(llm.model.graphs.encoder)
    monkeypatch.setattr(llm.model.graphs, "encoder", counted)
    assert llm.transcribe(x, sample_rate=RATE, language="en", max_new_tokens=8).token_ids == first.token_ids
    assert counted.calls == 0
    llm.transcribe(y, sample_rate=RATE, language="en", max_new_tokens=8)
    assert counted.calls == 1


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.update(format_version=9), "format_version 9"),
    (lambda r: r.pop("generation"), "'generation' is missing"),
    (lambda r: r["graphs"].update(decoder="../elsewhere.onnx"), "is not a listed file"),
    (lambda r: r["files"]["weights.bin"].update(size=-1 + r["files"]["weights.bin"]["size"]), "size"),
    (lambda r: r.update(format="decodert"), "not a decodert seq2seq record"),
])
def test_a_damaged_seq2seq_record_is_one_line(whisper, tmp_path, edit, message):
    import json
    import shutil

    from decodert.artifact.seq2seq import SEQ2SEQ_MANIFEST, read_seq2seq
    from decodert.errors import DecodertError

    src = whisper[0].model.dir
    art = tmp_path / "art"
    shutil.copytree(src, art)
    record = json.loads((art / SEQ2SEQ_MANIFEST).read_text())
    edit(record)
    (art / SEQ2SEQ_MANIFEST).write_text(json.dumps(record))
    with pytest.raises(DecodertError, match=message) as e:
        read_seq2seq(art)
    assert "\n" not in str(e.value)
