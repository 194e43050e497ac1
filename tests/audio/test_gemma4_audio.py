"""Gemma 4 audio against transformers running the model's own processor, on a tiny random checkpoint with an
audio tower (tests/helpers/tiny_gemma4_audio.py): log-mel features, the conformer's embeddings after the embedder,
the prompt ids, greedy tokens, a batch, a session, transcription, and a TensorRT-RTX build of audio.onnx."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tiny_gemma4_audio import MELS, RATE, make_tiny_gemma4_audio, reference_processor
from tiny_qwen3_asr import speech_like

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (seconds, seed): one block of 12 rows and less, several blocks, a clip cut mid-block, a long one
CLIPS = [(0.3, 0), (1.0, 1), (2.37, 2), (4.5, 3), (7.91, 4)]


def _clips() -> list[np.ndarray]:
    return [speech_like(sec, seed) for sec, seed in CLIPS] + [np.zeros(RATE, np.float32)]  # and silence


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("gemma4_audio")
    hf = make_tiny_gemma4_audio(root / "hf")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf)
    llm.close()


def _fresh(llm):
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()


def _float64_transform(fe, x: np.ndarray) -> np.ndarray:
    """Gemma4AudioFeatureExtractor's own transform (its window and filters) over float64 samples: rfft in float64."""
    n = min(x.size, 480_000)
    padded = np.zeros(-(-n // 128) * 128)
    padded[:n] = x[:n]
    mask = np.zeros(padded.size, np.int64)
    mask[:n] = 1
    mel, valid = fe._extract_spectrogram(padded, mask)
    return mel * valid[:, None]


@pytest.mark.parametrize("options", [dict(feature_size=MELS), dict(feature_size=128),
                                     dict(feature_size=MELS, preemphasis=0.97, input_scale_factor=2.0,
                                          per_bin_mean=list(np.linspace(-3, 1, MELS)),
                                          per_bin_stddev=list(np.linspace(0.5, 2, MELS))),
                                     dict(feature_size=MELS, preemphasis=0.9, preemphasis_htk_flavor=False,
                                          fft_overdrive=True, mel_floor=1e-5)])
def test_log_mel_equals_the_feature_extractor(options):
    """Features of speech-like clips, silence, a clip of two frames and one over 30 s (cut as the processor cuts it)
    equal Gemma4AudioFeatureExtractor's as Gemma4Processor calls it (a batch of one: padded to 128 samples): shapes,
    the valid frames (its frame mask), values (the same float32 STFT: seen equal). Its transform in float64 lies up
    to ~1e-3 away near the mel floor of 1e-3 (the float32 rfft's rounding), which the features follow instead."""
    from decodert.models.families.gemma4 import audio_features
    from decodert.runtime.audio.features_gemma4 import Gemma4MelSettings, log_mel

    fe = transformers.Gemma4AudioFeatureExtractor(**options)
    spec = type("A", (), {"num_mel_bins": options["feature_size"]})()
    s = Gemma4MelSettings.from_dict(audio_features({**options, "feature_size": options["feature_size"]}, spec))
    clips = _clips() + [speech_like(0.0203, 5), speech_like(31.0, 6)]
    gap = 0.0
    for x in clips:
        ref = fe([x], sampling_rate=RATE, return_tensors="np")
        mel, valid = log_mel(x, s)
        want, mask = ref["input_features"][0], ref["input_features_mask"][0]
        assert mel.shape == want.shape and valid == int(mask.sum()) and mask[:valid].all()
        np.testing.assert_allclose(mel, want, atol=1e-6, rtol=0)
        exact = _float64_transform(fe, x)
        gap = max(gap, float(np.abs(mel - exact).max()))
        if s.mel_floor >= 1e-3:  # a lower floor magnifies the STFT's rounding in quiet bins (1e-5: ~0.04)
            np.testing.assert_allclose(mel, exact, atol=2e-3, rtol=0)
    print(f"{options}: float32 STFT vs float64, largest gap {gap:.2e}")


def test_audio_embeddings_equal_the_audio_tower(g4):
    """audio.onnx rows within 1e-4 of get_audio_features (the conformer and the embedder), its valid rows, on the
    extractor's features, for clips of every length and silence."""
    llm, model, processor = g4
    for x in _clips():
        f = processor.feature_extractor([x], sampling_rate=RATE, return_tensors="pt")
        with torch.no_grad():
            out = model.model.get_audio_features(f["input_features"], f["input_features_mask"])
        want = out.pooler_output[out.attention_mask].numpy()
        got = llm.audio.embeddings(x)
        assert got.shape == want.shape == (llm.audio.spec.tokens(int(f["input_features_mask"].sum())), 64)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("audio", [dict(attention_chunk_size=4, attention_context_left=6, attention_context_right=3,
                                        conv_kernel_size=3, attention_logit_cap=2.0),
                                   dict(use_clipped_linears=False, attention_context_left=5)])
def test_other_attention_geometries_equal_the_audio_tower(tmp_path, audio):
    """The chunked attention's windows, right context, relative shift and cap, and a tower without clipped linears,
    on other configs: within 1e-4 of transformers."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = make_tiny_gemma4_audio(tmp_path / "hf", seed=1, **audio)
    export_model(hf, tmp_path / "art", target="ort", dtype="fp32", max_seq=256, max_batch=1, progress=False)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(hf).eval()
    fe = reference_processor(hf).feature_extractor
    with LLM.load(tmp_path / "art", backend="ort") as llm:
        for x in (speech_like(0.5, 7), speech_like(2.9, 8)):
            f = fe([x], sampling_rate=RATE, return_tensors="pt")
            with torch.no_grad():
                out = model.model.get_audio_features(f["input_features"], f["input_features_mask"])
            np.testing.assert_allclose(llm.audio.embeddings(x), out.pooler_output[out.attention_mask].numpy(),
                                       atol=1e-4, rtol=0)


def _ask(x: np.ndarray, question: str = "What is said?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "audio", "audio": (x, RATE)}, {"type": "text", "text": question}]}]


def _reference(processor, model, messages: list[dict], clips: list[np.ndarray], n: int = 10):
    """transformers' prompt ids and greedy tokens for ``messages`` (audio parts as the processor's placeholder)."""
    plain = [{**m, "content": [{"type": "audio"} if c["type"] == "audio" else c for c in m["content"]]}
             if not isinstance(m["content"], str) else m for m in messages]
    text = processor.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, audio=clips, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    return inputs["input_ids"][0].numpy(), out.tolist()


def test_prompt_ids_equal_the_processor(g4):
    """A chat with a clip: Gemma4Processor's ids (<|audio>, one <|audio|> per encoder row, <audio|>), the audio
    tokens held as the clip's ids."""
    from decodert.runtime.vision.tokens import is_image, text_ids

    llm, model, processor = g4
    for x in (speech_like(2.37, 2), speech_like(0.3, 0)):
        want, _ = _reference(processor, model, _ask(x), [x], n=1)
        turn = llm.chat_turn(llm.split_audio(_ask(x))[0], {})
        ids = llm.prompt_ids(llm._render(turn), (), [x])
        np.testing.assert_array_equal(text_ids(ids), want)
        assert int(is_image(ids).sum()) == llm.audio.spec.tokens(llm.audio.features.frames(x.size)[1])


def test_greedy_tokens_equal_generate(g4):
    """LLM.chat with a clip and a question generates transformers' greedy tokens for clips of every length and
    silence."""
    llm, model, processor = g4
    for x in _clips():
        _, want = _reference(processor, model, _ask(x), [x])
        got = llm.chat(_ask(x), max_new_tokens=10, temperature=0)
        assert got.token_ids[:len(want)] == want


def test_the_audio_rows_per_layer_inputs_read_the_pad_token(g4, tmp_path, monkeypatch):
    """The log-probabilities of the greedy tokens are transformers' within 1e-4; with the placeholder's per-layer
    inputs at the audio rows instead of the pad token's, they move away (the declaration matters)."""
    from decodert.export.checkpoints import checkpoint_hf
    from decodert.export.pipeline import export_model
    from decodert.models.families import gemma4
    from decodert.models.family import Family
    from decodert.runtime.llm import LLM

    llm, model, processor = g4
    x = speech_like(2.37, 2)
    plain = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is said?"}]}]
    inputs = processor(text=processor.apply_chat_template(plain, tokenize=False, add_generation_prompt=True), audio=[x],
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    want = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, tokens)]

    def logprobs(of) -> list[float]:
        got = of.chat(_ask(x), max_new_tokens=6, temperature=0, logprobs=True)
        assert got.token_ids == tokens
        return [lp.logprob for lp in got.logprobs]

    np.testing.assert_allclose(logprobs(llm), want, atol=1e-4)
    real = gemma4.spec_from_hf
    monkeypatch.setattr(gemma4, "spec_from_hf", lambda c: dataclasses.replace(
        real(c), images=dataclasses.replace(real(c).images, per_layer_token=None)))
    monkeypatch.setattr(checkpoint_hf, "family_for", lambda *a: Family.of(gemma4))
    export_model(llm.manifest.source.path, tmp_path / "broken", target="ort", dtype="fp32", max_seq=256,
                 max_batch=1, progress=False)
    with LLM.load(tmp_path / "broken", backend="ort") as broken:
        assert np.abs(np.array(logprobs(broken)) - want).max() > 1e-3


def test_a_batch_equals_the_clips_one_at_a_time(g4):
    llm, _, _ = g4
    asks = [_ask(x, q) for x, q in zip(_clips()[:4], ("What is said?", "Hi", "Who speaks?", "What is said?"))]
    _fresh(llm)
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    _fresh(llm)
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles


def test_a_session_follow_up_equals_a_fresh_chat_and_transformers(g4):
    """A session's second question about a clip prefills only the new turn, equals a fresh chat of the whole
    conversation, and that equals transformers' greedy tokens on it."""
    llm, model, processor = g4
    x = speech_like(2.37, 2)
    chat = llm.session()
    first = chat.chat(_ask(x)[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And who speaks?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the clip was not prefilled again
    _fresh(llm)
    history = chat.history[:-1]
    again = llm.chat(history, max_new_tokens=5, temperature=0)
    assert second.token_ids == again.token_ids
    _, want = _reference(processor, model, history, [x], n=5)
    assert again.token_ids[:len(want)] == want
    chat.close()


@pytest.mark.parametrize("language, prompt", [(None, None), ("en", None), ("de", "names: Ada, Bo")])
def test_transcribe_asks_with_the_instruction_and_equals_generate(g4, language, prompt):
    """LLM.transcribe: a user turn of the clip and INSTRUCTION (models/families/gemma4.py TRANSCRIPTION, the
    manifest's transcription style: runtime/audio/transcribe.py; a system turn with the prompt), greedy; its tokens
    are transformers' on the same conversation and its text their decoding."""
    from decodert.models.families.gemma4 import INSTRUCTION

    llm, model, processor = g4
    names = {None: "its original language", "en": "English", "de": "German"}
    for x in (speech_like(1.0, 1), np.zeros(RATE // 2, np.float32)):
        messages = ([{"role": "system", "content": [{"type": "text", "text": prompt}]}] if prompt else []) + [
            {"role": "user", "content": [{"type": "audio"}, {"type": "text",
                                                             "text": INSTRUCTION.format(language=names[language])}]}]
        _, want = _reference(processor, model, messages, [x], n=8)
        got = llm.transcribe(x, sample_rate=RATE, language=language, prompt=prompt, max_new_tokens=8, temperature=0)
        assert got.token_ids[:len(want)] == want
        assert got.text == processor.decode(want, skip_special_tokens=True).rstrip("\ufffd").strip()


def test_the_manifest_and_bad_clips(g4):
    """manifest.audio names the gemma4 encoder and Gemma 4's log-mel settings, `decodert inspect` shows them; a clip
    too short for one token or longer than 30 s is a one-line error."""
    from decodert.errors import DecodertError

    llm, _, _ = g4
    m = llm.manifest
    assert m.audio.spec["encoder"] == "gemma4" and m.audio.features["fft_length"] == 512
    assert m.audio.features["n_mels"] == MELS and m.model.images.per_layer_token == 0
    from decodert.export.artifact.inspect import inspect_artifact

    text = inspect_artifact(Path(m.source.path).parent / "art")  # the fixture's root/hf -> root/art
    assert "audio      2 layers (gemma4), d_model 32" in text and "blocks of 12 rows, 12 rows of left" in text
    with pytest.raises(DecodertError, match="too short to make one audio token") as e:
        llm.chat(_ask(np.zeros(100, np.float32)), max_new_tokens=2)
    assert "\n" not in str(e.value)
    # longer than the 30 s Gemma4Processor cuts to: refused in one line, never cut silently
    with pytest.raises(DecodertError, match=r"30\.01 s is longer than the 30 s") as e:
        llm.chat(_ask(np.zeros(480_160, np.float32)), max_new_tokens=2)
    assert "\n" not in str(e.value)


def test_the_family_reads_and_refuses(tmp_path):
    """A gemma4 config without an audio_config has no audio; a feature_size the tower cannot read is refused."""
    from decodert.errors import DecodertError
    from decodert.models.families import gemma4
    from tiny import tiny_config

    assert gemma4.audio_from_hf(tiny_config("gemma4")) is None
    assert gemma4.spec_from_hf(tiny_config("gemma4")).images is None
    a = gemma4.audio_from_hf({"model_type": "gemma4", "text_config": {"hidden_size": 64},
                              "audio_config": {"subsampling_conv_channels": [32, 8]}})
    assert a.num_mel_bins == 32 and a.context == 24 and a.positions == 13
    with pytest.raises(DecodertError, match="feature_size 128 differs"):
        gemma4.audio_features({"feature_size": 128}, a)
    with pytest.raises(DecodertError, match="dither"):
        gemma4.audio_features({"feature_size": 32, "dither": 1e-4}, a)


@pytest.mark.trt
def test_audio_graph_builds_with_tensorrt_rtx(g4, tmp_path):
    """audio.onnx of the trt target (standard ops: the masks static-shape inputs) parses and builds with
    TensorRT-RTX under its profile (clips up to 30 s), beside the text engines."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = g4
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    profile = engines["audio"].profile
    assert profile["input_features"]["max"] == [3024, MELS] and profile["key_valid"]["max"] == [63, 12, 24]
    assert [t["name"] for t in engines["audio"].io["outputs"]] == ["audio_embeds"]
