"""Whisper for TensorRT: the trt target's encoder.onnx / decoder.onnx (standard ops: TensorScatter into the cache,
decomposed attention) give transformers' greedy tokens on ONNX Runtime; ``decodert build`` builds encoder.engine and
decoder.engine with TensorRT-RTX on the CPU; and WhisperLLM on the trt backend (TensorRT and CUDA emulated:
tests/helpers/trt_emulator.py, each engine's graph on ONNX Runtime) gives the ort backend's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trt_emulator  # noqa: E402
from tiny_qwen3_asr import speech_like
from tiny_whisper import RATE, make_tiny_whisper, reference_extractor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLIPS = [(0.4, 0), (2.0, 1), (7.3, 2)]
TOKENS = 24


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from decodert.export.pipeline import export_model

    root = tmp_path_factory.mktemp("whisper_trt")
    hf = make_tiny_whisper(root / "hf")
    export_model(hf, root / "trt", target="trt", dtype="fp32", max_batch=4, progress=False)
    return hf, root / "trt"


@pytest.fixture()
def emulated(exported, tmp_path):
    import shutil

    out = tmp_path / "emulated"
    shutil.copytree(exported[1], out)
    trt_emulator.emulate_seq2seq_engines(out)
    return out


def _reference(model, x: np.ndarray, language: str | None) -> list[int]:
    features = reference_extractor()(x, sampling_rate=RATE, return_tensors="np")["input_features"]
    with torch.no_grad():
        out = model.generate(torch.from_numpy(features), language=language, max_new_tokens=TOKENS)[0].tolist()
    while out and out[-1] == model.generation_config.eos_token_id:
        out.pop()
    return out


def test_trt_graphs_are_standard_ops_and_give_transformers_tokens(exported):
    import onnx

    from decodert.runtime.llm import LLM

    hf, out = exported
    for name in ("encoder.onnx", "decoder.onnx"):
        graph = onnx.load(str(out / name), load_external_data=False).graph
        assert {n.domain for n in graph.node} == {""}, name  # no com.microsoft contrib ops
    ops = {n.op_type for n in onnx.load(str(out / "decoder.onnx"), load_external_data=False).graph.node}
    assert "TensorScatter" in ops and "GroupQueryAttention" not in ops
    assert json.loads((out / "seq2seq.json").read_text())["target"] == "trt"
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf).eval()
    llm = LLM.load(out, backend="ort")
    try:
        assert llm.model.backend == "ort"
        for (seconds, seed), language in zip(CLIPS, ("en", None, "en")):
            x = speech_like(seconds, seed)
            got = llm.transcribe(x, sample_rate=RATE, language=language, max_new_tokens=TOKENS)
            assert got.token_ids == _reference(model, x, language), (seconds, language)
    finally:
        llm.close()


def test_whisper_on_the_trt_backend_gives_the_ort_backends_tokens(emulated, monkeypatch):
    from decodert.runtime.llm import LLM

    _, trt = trt_emulator.install(monkeypatch)
    clips = [speech_like(s, seed) for s, seed in CLIPS] + [np.zeros(2 * RATE, np.float32), speech_like(41.0, 5)]
    ref, llm = LLM.load(emulated, backend="ort"), LLM.load(emulated, backend="trt")
    try:
        assert (ref.model.backend, llm.model.backend) == ("ort", "trt")
        assert trt.deserialized == ["encoder.onnx", "decoder.onnx"]
        for language in ("en", None):
            want = [r.token_ids for r in ref.transcribe_many(clips, sample_rate=RATE, language=language,
                                                             max_new_tokens=TOKENS)]
            got = [r.token_ids for r in llm.transcribe_many(clips, sample_rate=RATE, language=language,
                                                            max_new_tokens=TOKENS)]
            assert got == want and all(want), language
        single = llm.transcribe(clips[1], sample_rate=RATE, language="en", max_new_tokens=TOKENS)
        assert single.token_ids == ref.transcribe(clips[1], sample_rate=RATE, language="en",
                                                  max_new_tokens=TOKENS).token_ids
    finally:
        ref.close()
        llm.close()


def test_the_trt_backend_refuses_what_it_cannot_run_in_one_line(exported, emulated, monkeypatch, tmp_path):
    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf, out = exported
    trt_emulator.install(monkeypatch)
    ort_art = tmp_path / "ort"
    export_model(hf, ort_art, target="ort", dtype="fp32", max_batch=2, progress=False)
    for folder, message in ((out, "no TensorRT engines; run `decodert build"),
                            (ort_art, "--target ort artifact .*export with --target trt")):
        with pytest.raises(DecodertError, match=message) as e:
            LLM.load(folder, backend="trt")
        assert "\n" not in str(e.value)
    auto = LLM.load(out)
    assert auto.model.backend == "ort"  # auto: no engines -> ort
    auto.close()
    (emulated / "decoder.engine").write_bytes(b"truncated")
    with pytest.raises(DecodertError, match="decoder.engine: 9 bytes but the manifest recorded"):
        LLM.load(emulated, backend="trt")


@pytest.mark.trt
def test_whisper_engines_build_with_tensorrt_rtx(exported, tmp_path, capsys):
    """decodert build of the trt export: encoder.engine and decoder.engine (the cache update as KV_CACHE_UPDATE),
    their I/O equal to the graphs', recorded in seq2seq.json; bad builds are one line (exit 2)."""
    import shutil

    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.cli import main as cli_main
    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.export.trt_build import build_engines
    from decodert.export.trt_seq2seq import build_seq2seq_engines

    hf, exported_out = exported
    out = tmp_path / "trt"
    shutil.copytree(exported_out, out)
    engines = build_seq2seq_engines(out, progress=False)
    assert set(engines) == {"encoder", "decoder"}
    dec = engines["decoder"]
    assert dec.layers["KV_CACHE_UPDATE"] == 4  # 2 layers x K, V
    assert dec.profile["input_ids"] == {"min": [1, 1], "opt": [4, 1], "max": [4, 48]}
    assert dec.profile["past_key.0"]["max"] == [4, 2, 96, 16] and dec.profile["cross_key.0"]["min"] == [1, 2, 1500, 16]
    assert [t["name"] for t in engines["encoder"].io["outputs"]][:2] == ["encoder_hidden", "cross_key.0"]
    record = json.loads((out / "seq2seq.json").read_text())
    assert record["engines"]["decoder"]["sha256"] == dec.sha256 and (out / "decoder.engine").stat().st_size == dec.size
    assert cli_main(["build", str(out), "--no-progress", "--max-batch", "2", "--max-seq", "8"]) == 0
    assert "decoder.engine:" in capsys.readouterr().out
    assert json.loads((out / "seq2seq.json").read_text())["engines"]["decoder"]["profile"]["input_ids"]["max"] == [2, 8]
    ort_art = tmp_path / "ort"
    export_model(hf, ort_art, target="ort", dtype="fp32", max_batch=2, progress=False)
    for call, message in ((lambda: build_seq2seq_engines(ort_art, progress=False), "re-export with --target trt"),
                          (lambda: build_seq2seq_engines(out, max_seq=97, progress=False), "--max-seq 97 must be"),
                          (lambda: build_seq2seq_engines(out, precision="fp16", progress=False), "--fp16 does not match"),
                          (lambda: build_engines(out, progress=False), "encoder-decoder artifact")):
        with pytest.raises(DecodertError, match=message):
            call()
    assert cli_main(["build", str(ort_art), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("decodert: error: ")
