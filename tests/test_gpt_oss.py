"""gpt-oss against transformers: attention sinks, sliding (window 4 here) / full layers, YaRN, biases, clamped
SwiGLU experts; every target's logits, int4 experts, MXFP4 experts read exactly, TensorRT builds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from parity import backend, decodert_greedy, hf_reference, logits_parity, random_prompts  # noqa: E402
from tiny import tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.export.quantize.mxfp4 import dequantize_mxfp4  # noqa: E402
from decodert.export.quantize.quant import QuantConfig, dequantize, quantize  # noqa: E402
from decodert.models.families import gpt_oss  # noqa: E402
from decodert.models.common import hf_rope  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    src = tiny_checkpoint("gpt_oss")
    return src, transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def test_spec_and_yarn_match_transformers(model):
    src, m = model
    spec = open_checkpoint(src).spec
    assert [spec.layer_window(i) for i in range(2)] == [4, None] and spec.attention.sinks
    moe = spec.mlp(0)
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_beta) == (7.0, 1.702, 1.0) and spec.mlp(1) is moe
    rotary = m.model.rotary_emb
    np.testing.assert_allclose(spec.rope.inv_freq(spec.head_dim), rotary.inv_freq.numpy(), rtol=1e-6)
    assert spec.rope.attention_factor == pytest.approx(rotary.attention_scaling)
    default = gpt_oss.spec_from_hf(tiny_config("gpt_oss", layer_types=None))
    assert [default.is_sliding(i) for i in range(2)] == [True, False]
    with pytest.raises(DecodertError, match="attention_bias"):
        gpt_oss.spec_from_hf(tiny_config("gpt_oss", attention_bias=False))
    with pytest.raises(DecodertError, match="layer_types must list 2"):
        gpt_oss.spec_from_hf(tiny_config("gpt_oss", layer_types=["sliding_attention"]))
    explicit = hf_rope({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                            "original_max_position_embeddings": 64, "attention_factor": 0.5}})
    assert explicit.attention_factor == 0.5 and explicit.truncate


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_logits_and_greedy_match_transformers(model, tmp_path, target):
    src, m = model
    out = tmp_path / "a"
    export_model(src, out, target=target, max_seq=64, max_batch=4, progress=False)
    prompts = random_prompts((11, 4, 7))
    refs = [hf_reference(m, p, 13) for p in prompts]  # decode steps cross the window of 4
    assert logits_parity(out, refs[:1], prompts[:1], steps=12) < TOL
    assert logits_parity(out, refs, prompts, steps=12) < TOL
    assert decodert_greedy(backend(out), prompts, 13) == [toks for toks, _ in refs]
    graph = onnx.load(out / "decode.onnx", load_external_data=False).graph
    if target == "ort":  # the sinks ride on GroupQueryAttention's head_sink input
        gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == 2 and all(n.input[11].endswith(".sinks") for n in gqa)


def test_speculative_decoding_and_batching(model, tmp_path):
    out = tmp_path / "a"
    export_model(model[0], out, target="ort", max_seq=128, max_batch=4, progress=False)
    llm = LLM.load(out, backend="ort")
    rng = np.random.default_rng(5)
    ps = [np.tile(rng.integers(3, 512, 5), 4), rng.integers(3, 512, 9)]
    plain = [llm.generate(p, max_new_tokens=24).token_ids for p in ps]
    assert [llm.generate(p, max_new_tokens=24, speculative="ngram").token_ids for p in ps] == plain
    batch = llm.generate_many([Request(p, SamplingParams(max_new_tokens=24), speculative="ngram") for p in ps])
    assert [r.token_ids for r in batch] == plain


def test_int4_experts_equal_the_dequantized_model(model, tmp_path):
    src, _ = model
    cfg = QuantConfig(bits=4, block_size=16)
    out = tmp_path / "q"
    export_model(src, out, target="ort", max_seq=64, progress=False, quant=cfg)
    assert "QMoE" in {n.op_type for n in onnx.load(out / "decode.onnx", load_external_data=False).graph.node}
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rt = lambda w: dequantize(quantize(w, cfg), cfg)  # noqa: E731  rows are [out, in]
    with torch.no_grad():
        for layer in ref.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                lin.weight.copy_(torch.from_numpy(rt(lin.weight.numpy())))
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):  # stored [in, out]
                for j in range(p.shape[0]):
                    p[j].copy_(torch.from_numpy(rt(p[j].numpy().T).T))
        ref.lm_head.weight.copy_(torch.from_numpy(rt(ref.lm_head.weight.numpy())))
    prompts = random_prompts((9, 5), 3)
    assert logits_parity(out, [hf_reference(ref, p, 7) for p in prompts], prompts, steps=6) < TOL


def test_mxfp4_experts_are_dequantized_exactly(model, tmp_path):
    """An OpenAI-style checkpoint (experts as *_blocks + *_scales) reads as transformers dequantizes it,
    one expert at a time, and exports to the logits of transformers holding those values."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, _ = model
    tensors = load_file(src / "model.safetensors")
    rng = np.random.default_rng(0)
    dense = {}
    for i in range(2):
        for name, (n, k) in (("gate_up_proj", (64, 64)), ("down_proj", (64, 32))):  # [out, in] per expert
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            blocks = rng.integers(0, 256, (8, n, k // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 124, (8, n, k // 32), dtype=np.uint8)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            dense[key] = ref.numpy()  # transformers' parameter: [E, in, out]
            np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales).transpose(0, 2, 1), dense[key])
    folder = tmp_path / "mx"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / f).symlink_to(src / f)
    save_file(tensors, folder / "model.safetensors")
    ckpt = open_checkpoint(folder)
    np.testing.assert_array_equal(ckpt.expert("layers.1.experts.down", 5), dense["model.layers.1.mlp.experts.down_proj"][5].T)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, value in dense.items():
            ref.get_parameter(key).copy_(torch.from_numpy(value))
    export_model(folder, tmp_path / "out", target="ort", max_seq=64, progress=False)
    prompts = random_prompts((8,), 4)
    assert logits_parity(tmp_path / "out", [hf_reference(ref, p, 6) for p in prompts], prompts, steps=5) < TOL


@pytest.mark.trt
@pytest.mark.parametrize("quant", [None, QuantConfig(bits=4, block_size=16, symmetric=True)])
def test_trt_builds(model, tmp_path, quant):
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build

    out = tmp_path / "t"
    export_model(model[0], out, target="trt", dtype="fp16", max_seq=64, max_batch=2, progress=False, quant=quant)
    engines = trt_build.build_engines(out, progress=False)
    for rec in engines.values():  # sinks: the decomposed attention (TensorRT's attention layer has none)
        assert rec.layers["KV_CACHE_UPDATE"] == 4 and "ATTENTION_INPUT" not in rec.layers
    with pytest.raises(DecodertError, match="attention sinks has no CachedAttention plugin kernel"):
        export_model(model[0], tmp_path / "p", target="trt", dtype="fp16", max_seq=64, progress=False, plugins="always")


@pytest.mark.parametrize("qtype", ["F32", "MXFP4"])
def test_gguf(tmp_path, qtype):
    """llama.cpp's gpt-oss GGUF: gate and up split into ffn_gate_exps / ffn_up_exps (stacked, MXFP4 or float),
    biases, sinks, router; fused back interleaved one expert at a time. F32 equals the HF checkpoint exactly
    and exports to transformers' logits; MXFP4 experts dequantize to what the gguf package reads."""
    import gguf

    from tiny import make_tiny_gguf

    path = make_tiny_gguf("gpt_oss", tmp_path / "m.gguf", qtype="F32" if qtype == "F32" else "MXFP4")
    ckpt, hf = open_checkpoint(path), open_checkpoint(path.with_suffix(".hf"))
    assert ckpt.spec == hf.spec
    if qtype == "F32":
        for name in hf.names():
            np.testing.assert_array_equal(ckpt.tensor(name), hf.tensor(name), err_msg=name)
        m = transformers.AutoModelForCausalLM.from_pretrained(path.with_suffix(".hf"), dtype=torch.float32).eval()
        prompts = random_prompts((9, 3), 6)
        export_model(path, tmp_path / "out", target="ort", max_seq=64, progress=False)
        assert logits_parity(tmp_path / "out", [hf_reference(m, p, 8) for p in prompts], prompts, steps=7) < TOL
        return
    stacked = {t.name: t for t in gguf.GGUFReader(path).tensors}
    gate = stacked["blk.0.ffn_gate_exps.weight"]
    assert gguf.GGMLQuantizationType(gate.tensor_type).name == "MXFP4"
    whole = gguf.quants.dequantize(np.asarray(gate.data), gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(ckpt.expert("layers.0.experts.gate_up", 3)[0::2], whole.reshape(8, 32, 64)[3])


def test_sinks_with_an_int8_kv_cache(model, tmp_path):
    """GroupQueryAttention's head_sink (input 11) and k_scale / v_scale (12, 13) together, in schema order;
    an int8 cache keeps the logits close to the float cache's."""
    src, m = model
    out = tmp_path / "q"
    export_model(src, out, target="ort", max_seq=64, max_batch=4, progress=False, kv_dtype="int8")
    gqa = [n for n in onnx.load(out / "decode.onnx", load_external_data=False).graph.node
           if n.op_type == "GroupQueryAttention"]
    assert all(n.input[11].endswith(".sinks") and n.input[12] and n.input[13] for n in gqa)
    prompts = random_prompts((11, 4, 7))
    assert logits_parity(out, [hf_reference(m, p, 8) for p in prompts], prompts, steps=7) < 0.05
