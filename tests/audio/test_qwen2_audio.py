"""Qwen2-Audio against transformers running the model's own processor, on a tiny random checkpoint: the 30 s padded
log-mel, the encoder's embeddings and token counts, prompt ids, greedy tokens (transcription and chat), a batch, a
session, the openai client through the server, one-line refusals, and a TensorRT-RTX build of audio.onnx."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tiny_qwen2_audio import CHAT_TEMPLATE, MELS, RATE, make_tiny_qwen2_audio, reference_processor
from tiny_qwen3_asr import speech_like

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (seconds, seed): a few frames, one second, odd and even row counts, a long clip, almost the whole 30 s window
CLIPS = [(0.3, 0), (1.0, 1), (2.37, 2), (4.5, 3), (7.91, 4), (29.99, 5)]
INSTRUCTION = "Detect the language and recognize the speech:"  # models/families/qwen2_audio.py TRANSCRIPTION


@pytest.fixture(scope="module")
def q2a(tmp_path_factory):
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("qwen2_audio")
    hf = make_tiny_qwen2_audio(root / "hf")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf)
    llm.close()


def _clips():
    return [speech_like(sec, seed) for sec, seed in CLIPS] + [np.zeros(RATE, np.float32)]


def test_log_mel_equals_the_whisper_feature_extractor(q2a):
    """The manifest's log-mel settings give WhisperFeatureExtractor's features as Qwen2AudioProcessor calls it
    (padding="max_length" to 30 s): shapes, valid frames (the attention mask) and values within 1e-4 (its float32
    STFT's rounding; docs/features/audio.md)."""
    from decodert.runtime.audio.features import MelSettings, log_mel

    llm, _, processor = q2a
    s = MelSettings.from_dict(dict(llm.manifest.audio.features))
    assert s.pad_to == 30 * RATE and s.n_mels == MELS
    for x in _clips():
        ref = processor.feature_extractor(x, sampling_rate=RATE, padding="max_length", return_attention_mask=True,
                                          return_tensors="np")
        mel, valid = log_mel(x, s)
        assert mel.shape == ref["input_features"][0].shape == (MELS, 3000)
        assert valid == int(ref["attention_mask"][0].sum())
        np.testing.assert_allclose(mel, ref["input_features"][0], atol=1e-4, rtol=0)


def _reference_embeddings(model, processor, x):
    """transformers' encoder + projector on the processor's features, the rows Qwen2AudioModel places."""
    from transformers.masking_utils import create_bidirectional_mask

    f = processor.feature_extractor(x, sampling_rate=RATE, padding="max_length", return_attention_mask=True,
                                    return_tensors="pt")
    tower = model.model.audio_tower
    rows, tokens = tower._get_feat_extract_output_lengths(f["attention_mask"].sum(-1))
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(1, 1500, 1),
                                     attention_mask=(torch.arange(1500)[None] < rows[:, None]).long())
    with torch.no_grad():
        hidden = tower(f["input_features"], attention_mask=mask).last_hidden_state
        return model.model.multi_modal_projector(hidden)[0, :int(tokens)].numpy()


def test_audio_embeddings_equal_the_encoder_and_projector(q2a):
    """audio.onnx's rows within 1e-4 of transformers' audio tower + projector (which run the whole 30 s window and
    mask the keys past the clip), as many as Qwen2AudioProcessor's <|AUDIO|> count."""
    llm, model, processor = q2a
    for x in _clips():
        want = _reference_embeddings(model, processor, x)
        got = llm.audio.embeddings(x)
        count = processor(text="<|AUDIO|>", audio=x, return_tensors="np")["input_ids"][0].tolist().count(
            processor.audio_token_id)
        assert got.shape == want.shape == (count, 64)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _transcription_text(processor, prompt=None):
    messages = ([{"role": "system", "content": [{"type": "text", "text": prompt}]}] if prompt is not None else []) + [
        {"role": "user", "content": [{"type": "audio", "audio_url": "clip.wav"}, {"type": "text", "text": INSTRUCTION}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _generate(model, processor, text, clips, n, scores=False):
    inputs = processor(text=text, audio=clips or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    if not scores:
        return inputs, ids
    logprobs = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, ids)]
    return inputs, ids, logprobs


def test_prompt_ids_equal_the_processor(q2a):
    """The transcription prompt's ids, each clip's <|AUDIO|> expanded, equal the processor's for every clip."""
    from decodert.runtime.audio.transcribe import transcription_messages
    from decodert.runtime.vision.tokens import text_ids

    llm, _, processor = q2a
    for x in _clips():
        for prompt in (None, "Names: Ada"):
            inputs = processor(text=_transcription_text(processor, prompt), audio=x, return_tensors="np")
            messages, prefill = transcription_messages(x, RATE, None, prompt, llm.audio.transcription)
            messages, clips = llm.split_audio(messages)
            ids = llm.prompt_ids(llm.apply_chat_template(messages) + prefill, (), clips)
            assert text_ids(ids).tolist() == inputs["input_ids"][0].tolist()


def _decoded(processor, ids) -> str:
    """The answer's text less a trailing incomplete UTF-8 character (the incremental detokenizer holds it back)."""
    return processor.decode(ids, skip_special_tokens=True).rstrip("\ufffd").strip()


def test_transcribe_gives_transformers_greedy_tokens(q2a):
    """LLM.transcribe asks Qwen2-Audio's instruction (its prompt ids are the processor's) and generates
    transformers' greedy tokens for clips of every length and silence, each with its log-probability within 1e-4
    (the tiny model's greedy tokens loop, so the log-probabilities are what tells one clip's rows from another's);
    its text is the decoded answer."""
    llm, model, processor = q2a
    for x in _clips():
        _, want, logprobs = _generate(model, processor, _transcription_text(processor), [x], 12, scores=True)
        got = llm.transcribe(x, sample_rate=RATE, max_new_tokens=12, temperature=0, logprobs=True)
        assert got.token_ids[:len(want)] == want
        np.testing.assert_allclose([t.logprob for t in got.logprobs[:len(want)]], logprobs, atol=1e-4, rtol=0)
        assert got.text == _decoded(processor, want)


def _wav_part(x):
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, x, RATE, format="WAV", subtype="FLOAT")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}


def _ask(*clips, text="What is said?"):
    return [{"role": "user", "content": [_wav_part(x) for x in clips] + [{"type": "text", "text": text}]}]


def test_chat_with_input_audio_parts_equals_transformers(q2a):
    """OpenAI input_audio parts (base64 WAV) in a chat, one clip and two: transformers' tokens for the same
    messages through the template's "Audio N:" parts."""
    pytest.importorskip("soundfile")
    llm, model, processor = q2a
    for clips in ([speech_like(2.37, 2)], [speech_like(1.0, 1), speech_like(4.5, 3)]):
        messages = [{"role": "user", "content": [{"type": "audio", "audio_url": f"{i}.wav"} for i in range(len(clips))]
                     + [{"type": "text", "text": "What is said?"}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        _, want, logprobs = _generate(model, processor, text, clips, 10, scores=True)
        got = llm.chat(_ask(*clips), max_new_tokens=10, temperature=0, logprobs=True)
        assert got.token_ids[:len(want)] == want
        np.testing.assert_allclose([t.logprob for t in got.logprobs[:len(want)]], logprobs, atol=1e-4, rtol=0)


def _fresh(llm):
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()


def test_a_batch_equals_singles(q2a):
    pytest.importorskip("soundfile")
    llm, _, _ = q2a
    asks = [_ask(speech_like(0.3, 0)), _ask(speech_like(4.5, 3), text="Again?"), [{"role": "user", "content": "Hi"}],
            _ask(np.zeros(RATE, np.float32))]
    _fresh(llm)
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    _fresh(llm)
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles


def test_a_session_follow_up_equals_a_fresh_chat(q2a):
    """A session's second question about a clip prefills only the new turn and equals a full re-prefill."""
    pytest.importorskip("soundfile")
    llm, _, _ = q2a
    chat = llm.session()
    first = chat.chat(_ask(speech_like(2.37, 2))[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And who speaks?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the clip was not prefilled again
    _fresh(llm)
    again = llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0)
    assert second.token_ids == again.token_ids
    chat.close()


def test_bad_requests_are_one_line(q2a):
    """A clip over the encoder's 30 s window and a forced language (the instruction detects it) are refused."""
    from decodert.errors import DecodertError

    llm, _, _ = q2a
    with pytest.raises(DecodertError, match="longer than the 3000") as e:
        llm.transcribe(np.zeros(RATE * 31, np.float32), sample_rate=RATE)
    assert "\n" not in str(e.value)
    with pytest.raises(DecodertError, match="language 'en' cannot be forced"):
        llm.transcribe(np.zeros(RATE, np.float32), sample_rate=RATE, language="en")


def test_openai_client_transcriptions_equal_transformers(q2a):
    """client.audio.transcriptions.create against the served tiny model returns transformers' answer to the
    transcription instruction (json and text); a forced language is a one-line 400."""
    soundfile = pytest.importorskip("soundfile")
    openai = pytest.importorskip("openai")
    from serve_helpers import running

    from decodert.serve.protocols.transcriptions import MAX_TOKENS

    llm, model, processor = q2a
    buf = io.BytesIO()
    soundfile.write(buf, speech_like(2.37, 2), RATE, format="WAV", subtype="PCM_16")
    wav = buf.getvalue()
    decoded = soundfile.read(io.BytesIO(wav), dtype="float32")[0]  # what the server reads: 16-bit PCM
    _, want = _generate(model, processor, _transcription_text(processor), [decoded], MAX_TOKENS)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav, "audio/wav"), temperature=0)
        assert got.text == _decoded(processor, want)
        text = client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav), response_format="text")
        assert text == _decoded(processor, want)
        with pytest.raises(openai.BadRequestError, match="cannot be forced") as e:
            client.audio.transcriptions.create(model="tiny", file=("clip.wav", wav), language="en")
        assert "\n" not in e.value.message


def test_the_manifest_records_the_whisper_encoder(q2a):
    llm, _, _ = q2a
    a = llm.manifest.audio
    assert a.spec["encoder"] == "whisper" and a.spec["max_positions"] == 1500
    assert a.transcription == {"instruction": INSTRUCTION} and a.features["pad_to"] == 30 * RATE
    assert [t.name for t in a.graph.inputs] == ["input_features", "key_valid", "token_slots"]
    assert CHAT_TEMPLATE == llm.chat_template


@pytest.mark.trt
def test_audio_graph_builds_with_tensorrt_rtx(q2a, tmp_path):
    """audio.onnx of the trt target parses and builds with TensorRT-RTX under its profile (clips up to 30 s)."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = q2a
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    profile = engines["audio"].profile
    assert profile["input_features"]["max"] == [1, MELS, 3000] and profile["key_valid"]["max"] == [1, 1500]
    assert [t["name"] for t in engines["audio"].io["outputs"]] == ["audio_embeds"]


def test_the_family_reads_both_weight_namings_and_refuses_bad_configs():
    """The hub's names (language_model.model.*) and transformers 5's (model.language_model.*) map to the same
    tables; a feature_size other than the encoder's mel bins and a scaled embedding are one-line errors."""
    from decodert.errors import DecodertError
    from decodert.models import family_for

    family = family_for("qwen2_audio")
    for key in ("language_model.model.layers.0.mlp.up_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"):
        assert family.sanitize(key) == "model.layers.0.mlp.up_proj.weight"
    assert family.sanitize("language_model.lm_head.weight") == "lm_head.weight"
    assert family.sanitize("model.audio_tower.conv1.weight") == "audio_tower.conv1.weight"
    config = {"model_type": "qwen2_audio", "audio_config": {"num_mel_bins": MELS, "d_model": 32, "encoder_layers": 1,
                                                            "encoder_attention_heads": 2, "encoder_ffn_dim": 64},
              "text_config": {"model_type": "qwen2", "hidden_size": 64}}
    audio = family.audio_from_hf(config)
    assert (audio.encoder, audio.max_positions, audio.out_hidden, audio.tokens(3000), audio.tokens(100)) == (
        "whisper", 1500, 64, 750, 25)
    with pytest.raises(DecodertError, match="feature_size 80 differs"):
        family.audio_features({"feature_size": 80}, audio)
    with pytest.raises(DecodertError, match="scale_embedding"):
        family.audio_from_hf({**config, "audio_config": {**config["audio_config"], "scale_embedding": True}})
