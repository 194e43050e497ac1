"""Qwen3.5-MoE with images (Qwen3_5MoeForConditionalGeneration): Qwen3.5's mixers, tower and M-RoPE
(tests/vision/test_vision_qwen3_5.py) with every MLP a renormalised top-k of SwiGLU experts beside a shared expert gated
per token. Against transformers on a tiny random checkpoint: logits and greedy tokens with one and two images; the
portable and trt-target graphs' tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from seeds import rng_for
from tiny_qwen_vl import ask, make_tiny_qwen_vl, random_image, reference_inputs, reference_processor, reference_tokens

torch = pytest.importorskip("torch")
pytest.importorskip("PIL.Image")
MAX_SEQ = 512  # as tests/vision/test_vision_qwen3_5.py


@pytest.fixture(scope="module")
def q35moe(request, tmp_path_factory):
    """Qwen3.5-MoE: the same tower and mixers, every MLP 4 experts (top 2) beside a gated shared expert."""
    import transformers

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("qwen3_5_moe_vl")
    hf = make_tiny_qwen_vl(root / "hf", seed=int(rng_for(request).integers(1000)), kind="qwen3_5_moe")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=MAX_SEQ, max_batch=2, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf, "qwen3_5_moe")
    llm.close()


def test_moe_logits_and_greedy_tokens_equal_transformers(q35moe, rng):
    llm, model, proc = q35moe
    spec = llm.manifest.model.spec()
    moe = spec.mlp(0)
    assert (spec.family, moe.num_experts, moe.experts_per_token, moe.expert_size) == ("qwen3_5_moe", 4, 2, 32)
    assert moe.shared_gate and moe.shared.size == 48 and spec.mrope is not None and {spec.mlp(i) for i in range(3)} == {moe}
    from decodert.models import family_for

    text = json.loads((Path(llm.manifest.source.path) / "config.json").read_text())["text_config"]
    plain = family_for("qwen3_5_moe_text").spec_from_hf(text)  # the text model alone: no M-RoPE, same MLPs
    assert plain.mrope is None and plain.images is None and plain.mlp(0) == moe
    img = random_image(rng, 100, 160)
    _, text, ids = llm.prepare(ask(img), chat=True).rendered
    ref = reference_inputs(proc, text, [img])
    cache = llm.backend.allocate(1)
    first = llm.backend.prefill(cache, [0], [ids], True)
    with torch.no_grad():
        out = model(**ref)
    np.testing.assert_allclose(first.logits[0], out.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)
    for msgs in (ask(img), ask(random_image(rng, 90, 60), random_image(rng, 64, 64), text="and")):
        _, text, _ = llm.prepare(msgs, chat=True).rendered
        images = [p["image"] for p in msgs[0]["content"] if p["type"] == "image"]
        assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == \
            reference_tokens(model, proc, text, images)


@pytest.mark.parametrize("target", ["portable", "trt"])
def test_moe_other_targets_give_the_ort_tokens(q35moe, tmp_path, target, rng):
    """The standard-op experts and the gated shared expert (portable; trt graphs run by ONNX Runtime)."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    llm, _, _ = q35moe
    export_model(llm.manifest.source.path, tmp_path / "p", target=target, dtype="fp32", max_seq=MAX_SEQ,
                 progress=False, **({"plugins": "never"} if target == "trt" else {}))
    msgs = ask(random_image(rng, 70, 50))
    with LLM.load(tmp_path / "p", backend="ort") as other:
        assert other.chat(msgs, max_new_tokens=6, temperature=0).token_ids == \
            llm.chat(msgs, max_new_tokens=6, temperature=0).token_ids


@pytest.mark.trt
def test_tensorrt_rtx_builds_the_moe_text_and_vision_engines(q35moe, tmp_path):
    """The trt-target graphs (standard-op experts, the gated shared expert, M-RoPE offsets as engine inputs) parse
    and build with TensorRT-RTX, the vision engine under its own profile."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = q35moe
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    assert {"vision", "prefill", "decode"} <= set(engines)
    for graph in ("prefill", "decode"):
        assert "rope_offsets" in {t["name"] for t in engines[graph].io["inputs"]}, graph
    assert [t["name"] for t in engines["vision"].io["outputs"]] == ["image_embeds"]
