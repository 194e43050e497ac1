"""Mixture-of-experts (Qwen3-MoE) against transformers. The battery (tests/helpers/battery.py): logits and greedy
tokens of every target, batching, speculation, sessions, TensorRT-RTX builds (fp16 and int4 experts), the
emulated trt backend; here: the spec, the experts read one at a time, each target's ops, int4 experts (exact
against the dequantized model, and their agreement with fp32), the memory check, GGUF, the one-line errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import transformers

from battery import Family, Parity, Runtime, TrtBuild, TrtEmulator
from parity import backend, decodert_greedy, hf_reference, logits_parity, random_prompts  # noqa: E402
from tiny import tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoints.checkpoint import Checkpoint  # noqa: E402
from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.export.quantize.quant import QuantConfig, dequantize, quantize  # noqa: E402
from decodert.models.families import qwen3_moe  # noqa: E402
from decodert.models.spec import ModelSpec  # noqa: E402
from decodert.plugins.ops.moe import moe_ref  # noqa: E402
from decodert.runtime.backends import memory  # noqa: E402

TOL = 1e-4


def experts_engines(engines: dict, m, quant) -> None:
    """TensorRT-RTX builds the experts as standard layers (TopK, Gather, MatMul; int4 as block DEQUANTIZE), no
    plugin."""
    for name, rec in engines.items():
        assert rec.layers["TOPK"] >= 2, (name, rec.layers)  # the router and the argmax
        assert (rec.layers.get("DEQUANTIZE", 0) >= 2) == (quant is not None), (name, rec.layers)


QWEN3_MOE = Family("qwen3_moe", trt_quants=(None, QuantConfig(bits=4, block_size=32, symmetric=True)),
                   trt_layers=experts_engines)


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator):
    entries = (QWEN3_MOE,)


@pytest.fixture(scope="module")
def moe(family_artifacts):
    return family_artifacts.source(QWEN3_MOE), family_artifacts.model(QWEN3_MOE)


@pytest.fixture(scope="module")
def exported(moe, family_artifacts, tmp_path_factory):
    """(target, quant) -> the export (fp32 weights: the battery's, max_seq 128)."""
    made: dict = {}

    def get(target: str, quant: QuantConfig | None = None):
        if quant is None:
            return family_artifacts.artifact(QWEN3_MOE, target)
        key = (target, quant)
        if key not in made:
            out = tmp_path_factory.mktemp(f"moe-{target}") / "a"
            export_model(moe[0], out, target=target, max_seq=128, max_batch=4, progress=False, quant=quant)
            made[key] = out
        return made[key]

    return get


def test_spec_reads_the_router_and_the_dense_layers():
    spec = qwen3_moe.spec_from_hf(tiny_config("qwen3_moe"))
    moe = spec.mlp(0)
    assert (moe.num_experts, moe.experts_per_token, moe.expert_size) == (8, 2, 32)
    assert moe.renormalize and mlp_kinds(spec) == ("moe", "dense")
    cfg = tiny_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2,
                      norm_topk_prob=False)
    cfg["num_local_experts"] = cfg.pop("num_experts")  # transformers 5 writes num_experts under this name
    spec = qwen3_moe.spec_from_hf(cfg)
    assert mlp_kinds(spec) == ("dense", "moe", "dense", "moe") and not spec.mlp(1).renormalize
    assert mlp_kinds(ModelSpec.from_dict(spec.to_dict())) == mlp_kinds(spec)


def mlp_kinds(spec) -> tuple[str, ...]:
    return tuple(layer.mlp_kind for layer in spec.layers)


@pytest.mark.parametrize("change,match", [
    (dict(num_experts=None), "has no num_experts"),
    (dict(num_experts_per_tok=9), "router top-k 9 must be 1..8"),
    (dict(shared_expert_intermediate_size=16), "shared expert"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step 0"),
])
def test_layouts_decodert_cannot_map_are_one_line_errors(tiny_checkpoint, tmp_path, change, match):
    src = tiny_checkpoint("qwen3_moe")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).symlink_to(f)
    config = {**json.loads((src / "config.json").read_text()), **change}
    config.pop("num_local_experts", None) if "num_experts" in change else None
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(DecodertError, match=match) as e:
        open_checkpoint(bad)
    assert "\n" not in str(e.value) and str(bad / "config.json") in str(e.value)


def test_missing_or_misshapen_experts_name_the_tensor(tiny_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint("qwen3_moe")
    tensors = load_file(src / "model.safetensors")
    for case, edit in (("missing", lambda t: t.pop("model.layers.0.mlp.experts.7.up_proj.weight")),
                       ("shape", lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight": np.zeros((64, 16), np.float32)})),
                       ("router", lambda t: t.update({"model.layers.0.mlp.gate.weight": np.zeros((6, 64), np.float32)}))):
        bad = tmp_path / case
        bad.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (bad / f).symlink_to(src / f)
        t = dict(tensors)
        edit(t)
        save_file(t, bad / "model.safetensors")
        with pytest.raises(DecodertError) as e:
            open_checkpoint(bad)
        msg = str(e.value)
        assert "\n" not in msg and ("experts.7.up_proj" in msg if case == "missing" else
                                    "experts.3.down_proj" in msg if case == "shape" else "mlp.gate.weight" in msg)


def test_experts_are_read_one_at_a_time_and_interleaved(moe):
    src, model = moe
    ckpt = open_checkpoint(src)
    experts = model.model.layers[0].mlp.experts  # transformers 5: gate_up_proj [E, 2 Ie, h] rows gate | up
    ie = ckpt.spec.mlp(0).expert_size
    for j in (0, 5):
        gate_up = ckpt.expert("layers.0.experts.gate_up", j)
        ref = experts.gate_up_proj[j].detach().numpy()
        np.testing.assert_array_equal(gate_up[0::2], ref[:ie])
        np.testing.assert_array_equal(gate_up[1::2], ref[ie:])
        np.testing.assert_array_equal(ckpt.expert("layers.0.experts.down", j), experts.down_proj[j].detach().numpy())
    assert ckpt.tensor("layers.0.experts.down").shape == (8, 64, 32)
    np.testing.assert_array_equal(ckpt.tensor("layers.0.router"), model.model.layers[0].mlp.gate.weight.detach().numpy())
    assert "layers.1.gate_up" in ckpt.names() and "layers.1.router" not in ckpt.names()  # mlp_only_layers


def test_numpy_reference_equals_the_transformers_block(moe):
    src, model = moe
    ckpt = open_checkpoint(src)
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    ref = model.model.layers[0].mlp(torch.from_numpy(x)[None]).detach().numpy()[0]
    got = moe_ref(x, ckpt.tensor("layers.0.router"), ckpt.tensor("layers.0.experts.gate_up"),
                  ckpt.tensor("layers.0.experts.down"), k=2, renormalize=True)
    np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_the_experts_lower_to_each_targets_ops(exported, target):
    """The ort graph runs the experts in ONNX Runtime's MoE op, the others as TopK, Gather and MatMuls (the battery's
    exports: their logits and tokens are transformers')."""
    ops = {n.op_type for n in onnx.load(exported(target) / "decode.onnx", load_external_data=False).graph.node}
    assert ("MoE" in ops) == (target == "ort") and ("TopK" in ops) == (target != "ort")


def _dequantized_model(src, cfg: QuantConfig):
    """transformers with every quantized weight (linears, experts, head) replaced by what the artifact stores."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rt = lambda w: torch.from_numpy(dequantize(quantize(w.detach().numpy(), cfg), cfg))  # noqa: E731
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
                lin.weight.copy_(rt(lin.weight))
            experts = getattr(layer.mlp, "experts", None)
            for p in () if experts is None else (experts.gate_up_proj, experts.down_proj):
                for j in range(p.shape[0]):  # rows are quantized independently: their order does not matter
                    p[j].copy_(rt(p[j]))
        model.lm_head.weight.copy_(rt(model.lm_head.weight))
    return model


@pytest.mark.parametrize("target,symmetric", [("ort", False), ("ort", True), ("portable", False), ("trt", True)])
def test_int4_experts_equal_the_dequantized_model(moe, exported, target, symmetric):
    cfg = QuantConfig(bits=4, block_size=32, symmetric=symmetric)
    out = exported(target, cfg)
    graph = onnx.load(out / "decode.onnx", load_external_data=False).graph
    assert ("QMoE" in {n.op_type for n in graph.node}) == (target == "ort")
    prompts = random_prompts((9, 4), 7)
    refs = [hf_reference(_dequantized_model(moe[0], cfg), p, 9) for p in prompts]
    assert logits_parity(out, refs, prompts, steps=8) < TOL


def test_int4_agrees_with_fp32_on_most_tokens(exported):
    """Teacher-forced top-1 agreement of the int4 artifact (QMoE experts, MatMulNBits elsewhere) with
    the fp32 one over 4 prompts x 48 steps: 0.73 here (block 32; 0.83 with block 16). The tiny random
    model's logits are close together, so this is a floor, not a quality figure."""
    prompts = random_prompts((11, 4, 7, 20), 1)
    ref = np.array(decodert_greedy(backend(exported("ort")), prompts, 48))
    be = backend(exported("ort", QuantConfig(bits=4, block_size=32)))
    cache, slots = be.allocate(4), [0, 1, 2, 3]
    got = [be.prefill(cache, slots, prompts, want_logits=False).next_token.copy()]
    for j in range(ref.shape[1] - 1):
        got.append(be.decode(cache, slots, ref[:, j].copy(), want_logits=False).next_token.copy())
    rate = float((np.stack(got, 1) == ref).mean())
    assert rate >= 0.6, rate


def test_export_streams_experts(moe, tmp_path, monkeypatch):
    """The export reads experts one at a time (Checkpoint.expert), never a layer's stack (Checkpoint.tensor)."""
    read = []
    real_tensor, real_expert = Checkpoint.tensor, Checkpoint.expert

    def tensor(self, name):
        assert ".experts." not in name, f"{name} read as one stacked float32 array"
        return real_tensor(self, name)

    def expert(self, name, j):
        read.append((name, j))
        return real_expert(self, name, j)

    monkeypatch.setattr(Checkpoint, "tensor", tensor)
    monkeypatch.setattr(Checkpoint, "expert", expert)
    for quant in (None, QuantConfig(bits=4, block_size=32)):
        read.clear()
        export_model(moe[0], tmp_path / str(quant is None), target="ort", max_seq=32, progress=False, quant=quant)
        assert sorted(read) == sorted((f"layers.0.experts.{w}", j) for w in ("gate_up", "down") for j in range(8))


def test_memory_check_counts_every_expert(exported, monkeypatch):
    out = exported("ort")
    size = (out / "weights.bin").stat().st_size
    monkeypatch.setattr(memory, "available_bytes", lambda: int(size * 1.05))
    with pytest.raises(DecodertError, match="all 8 experts of each MoE layer, not only the 2") as e:
        backend(out)
    assert "\n" not in str(e.value)


def test_block_size_must_divide_the_expert_width(moe, tmp_path):
    with pytest.raises(DecodertError, match="--block-size 64 must divide the experts' input width 32"):
        export_model(moe[0], tmp_path / "q", target="ort", max_seq=32, progress=False,
                     quant=QuantConfig(bits=4, block_size=64))
    assert not (tmp_path / "q").exists()


def test_gguf_stacked_experts(tmp_path):
    """llama.cpp's qwen3moe GGUF: router ffn_gate_inp, experts stacked in ffn_{gate,up,down}_exps [E, ...];
    one expert's rows are sliced before dequantising (Q8_0 here), and an F32 file exports to the
    transformers logits."""
    import gguf

    from tiny import make_tiny_gguf

    path = make_tiny_gguf("qwen3_moe", tmp_path / "m.gguf", mlp_only_layers=[])
    ckpt, hf = open_checkpoint(path), open_checkpoint(path.with_suffix(".hf"))
    assert ckpt.spec == hf.spec and mlp_kinds(ckpt.spec) == ("moe", "moe")
    for name in hf.names():
        np.testing.assert_array_equal(ckpt.tensor(name), hf.tensor(name))
    model = transformers.AutoModelForCausalLM.from_pretrained(path.with_suffix(".hf"), dtype=torch.float32).eval()
    prompts = random_prompts((10, 5), 2)
    export_model(path, tmp_path / "out", target="ort", max_seq=64, progress=False)
    assert logits_parity(tmp_path / "out", [hf_reference(model, p, 9) for p in prompts], prompts, steps=8) < TOL

    q8 = make_tiny_gguf("qwen3_moe", tmp_path / "q8.gguf", qtype="Q8_0", mlp_only_layers=[])
    ckpt = open_checkpoint(q8)
    stacked = {t.name: t for t in gguf.GGUFReader(q8).tensors}["blk.1.ffn_down_exps.weight"]
    whole = gguf.quants.dequantize(np.asarray(stacked.data), gguf.GGMLQuantizationType.Q8_0).reshape(8, 64, 32)
    np.testing.assert_array_equal(ckpt.expert("layers.1.experts.down", 6), whole[6])
