"""Qwen3-ASR on the trt backend (TensorRT and CUDA emulated: tests/helpers/trt_emulator.py; each engine's graph runs on
ONNX Runtime): audio.engine encodes the clip, the prefill engine places its rows as image rows, and the greedy
tokens and transcriptions equal the ort backend's on the same artifact (and transformers' for one clip)."""

from __future__ import annotations

import numpy as np
import pytest

import trt_emulator  # noqa: E402
from tiny_qwen3_asr import RATE, make_tiny_qwen3_asr, reference_processor, speech_like

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLIPS = [(0.3, 0), (2.37, 2), (7.91, 4)]  # under the minimum, a window cut mid-way, several windows


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from decodert.export.pipeline import export_model

    root = tmp_path_factory.mktemp("qwen3_asr_trt")
    hf = make_tiny_qwen3_asr(root / "hf")
    out = root / "trt"
    export_model(hf, out, target="trt", dtype="fp32", max_seq=512, max_batch=4, progress=False, plugins="never")
    trt_emulator.emulate_engines(out, scratch={"prefill": 8192, "decode": 4096, "verify": 16384, "audio": 4096})
    return hf, out


@pytest.fixture()
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


def _chat(x, text="Transcribe it."):
    return [{"role": "user", "content": [{"type": "audio", "audio": (x, RATE)}, {"type": "text", "text": text}]}]


def test_transcriptions_give_the_ort_backends_tokens(artifact, emulator):
    from decodert.runtime.llm import LLM

    hf, out = artifact
    _, trt = emulator
    clips = [speech_like(sec, seed) for sec, seed in CLIPS] + [np.zeros(RATE, np.float32)]
    with LLM.load(out, backend="ort") as ref, LLM.load(out, backend="trt") as llm:
        assert llm.backend.name == "trt" and llm.audio is not None and llm.audio.session is llm.backend.audio
        for x in clips:
            want = ref.transcribe(x, sample_rate=RATE, max_new_tokens=10, temperature=0)
            got = llm.transcribe(x, sample_rate=RATE, max_new_tokens=10, temperature=0)
            assert (got.token_ids, got.text) == (want.token_ids, want.text)
            np.testing.assert_allclose(llm.audio.embeddings(x), ref.audio.embeddings(x), atol=1e-5, rtol=0)
        assert "audio.onnx" in trt.deserialized  # the audio engine ran, not an ORT session
        forced = llm.transcribe(clips[1], sample_rate=RATE, language="en", max_new_tokens=8, temperature=0)
        assert forced.token_ids == ref.transcribe(clips[1], sample_rate=RATE, language="en", max_new_tokens=8, temperature=0).token_ids
        asks = [_chat(clips[0]), _chat(clips[2], "Again?"), [{"role": "user", "content": "Hi"}]]
        want_chat = [ref.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
        assert [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks] == want_chat
        batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
        assert [r.token_ids for r in batch] == want_chat
    # the same tokens as transformers' greedy generate on the checkpoint
    model = transformers.Qwen3ASRForConditionalGeneration.from_pretrained(hf).eval()
    inputs = reference_processor(hf).apply_transcription_request(clips[1])
    with torch.no_grad():
        ref_ids = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    with LLM.load(out, backend="trt") as llm:
        got = llm.transcribe(clips[1], sample_rate=RATE, max_new_tokens=10, temperature=0).token_ids
    assert got[: len(ref_ids)] == ref_ids.tolist()


def test_engines_without_audio_engine_refuse_audio_in_one_line(artifact, emulator, tmp_path):
    """Engines built before audio.engine was: text runs, a clip is one line naming the rebuild."""
    import shutil

    from decodert.errors import DecodertError
    from decodert.runtime.llm import LLM

    _, out = artifact
    old = tmp_path / "old"
    shutil.copytree(out, old)
    trt_emulator.emulate_engines(old, graphs=("prefill", "decode"))
    with LLM.load(old, backend="trt") as llm:
        assert llm.audio is None and llm.backend.audio is None
        assert llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, temperature=0).token_ids
        with pytest.raises(DecodertError, match="run `decodert build` again") as e:
            llm.transcribe(np.zeros(RATE, np.float32), sample_rate=RATE, max_new_tokens=2)
        assert "\n" not in str(e.value)
