"""gpt-oss against transformers: attention sinks, sliding (window 4 here) / full layers, YaRN, biases, clamped
SwiGLU experts. The battery (tests/helpers/battery.py): every target's logits and greedy tokens, batching,
speculation, sessions, TensorRT-RTX builds (fp16 and int4), the emulated trt backend; here: the spec and YaRN,
the sinks' lowering, int4 experts, MXFP4 experts read exactly, GGUF, an int8 cache."""

from __future__ import annotations


import numpy as np
import onnx
import pytest
import torch
import transformers

from battery import Family, Parity, Runtime, TrtBuild, TrtEmulator
from parity import hf_reference, logits_parity, random_prompts  # noqa: E402
from tiny import tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.export.quantize.mxfp4 import dequantize_mxfp4  # noqa: E402
from decodert.export.quantize.quant import QuantConfig, dequantize, quantize  # noqa: E402
from decodert.models.families import gpt_oss  # noqa: E402
from decodert.models.common import hf_rope  # noqa: E402

TOL = 1e-4


def sinks_engines(engines: dict, m, quant) -> None:
    """Sinks: the decomposed attention (TensorRT's attention layer has none)."""
    for name, rec in engines.items():
        assert "ATTENTION_INPUT" not in rec.layers, (name, rec.layers)


# the decode steps of the battery's parity cross the window of 4
GPT_OSS = Family("gpt_oss", steps=12, trt_quants=(None, QuantConfig(bits=4, block_size=16, symmetric=True)),
                 trt_layers=sinks_engines)


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator):
    entries = (GPT_OSS,)


@pytest.fixture(scope="module")
def model(family_artifacts):
    return family_artifacts.source(GPT_OSS), family_artifacts.model(GPT_OSS)


def test_the_sinks_ride_on_group_query_attention(family_artifacts):
    """The ort graph (the battery's export) hands each layer's sinks to GroupQueryAttention's head_sink input."""
    graph = onnx.load(family_artifacts.artifact(GPT_OSS, "ort") / "decode.onnx", load_external_data=False).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(n.input[11].endswith(".sinks") for n in gqa)


def test_sinks_have_no_plugin_kernel(model, tmp_path):
    with pytest.raises(DecodertError, match="attention sinks has no CachedAttention plugin kernel"):
        export_model(model[0], tmp_path / "p", target="trt", dtype="fp16", max_seq=64, progress=False, plugins="always")


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
