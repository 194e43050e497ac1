"""GGUF Q4_0 / Q8_0 weights transcoded exactly into decodert's int4 / int8 blocks (export/quantize/quant_gguf.py):
the blocks bit for bit, the rule deciding which weights are transcoded, fused and mixed-type weights,
the manifest record, and exported artifacts against transformers running GGUF's dequantized weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from decodert.cli import main as cli_main
from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.artifact.manifest import WeightQuantRecord, load_manifest
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import QuantConfig, WeightQuant, dequantize, quantize
from decodert.export.quantize.quant_gguf import transcode, transcoded_as
from decodert.export.quantize.weight_layouts import LAYOUTS
from parity import hf_reference, logits_parity
from tiny import make_tiny_gguf

Q = gguf.GGMLQuantizationType
BITS = {"Q4_0": 4, "Q8_0": 8}
TOL = 1e-5  # the same numbers on both sides: only the summation order differs


def _sym(bits: int) -> WeightQuant:
    return WeightQuant(bits, 32, True, "transcoded")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(family, qtype, mixed) -> a tiny GGUF; mixed: blk.0.attn_k is Q8_0 while the rest is `qtype`."""
    made: dict[tuple, Path] = {}

    def make(family: str, qtype: str, mixed: bool = False) -> Path:
        if (family, qtype, mixed) not in made:
            raw = None
            if mixed:  # k of layer 0: [2 kv heads * 16, 64], random values (the loader un-permutes them like any k)
                k = np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32) * 0.1
                raw = {"blk.0.attn_k.weight": ("Q8_0", gguf.quants.quantize(k, Q.Q8_0))}
            folder = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}")
            made[family, qtype, mixed] = make_tiny_gguf(family, folder / f"{family}.gguf", qtype, raw=raw)
        return made[family, qtype, mixed]

    return make


def _gguf_model(path: Path):
    """transformers' model of a GGUF file: every weight dequantized with the gguf package, float32."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32").eval()


# -- the blocks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_transcode_is_bit_exact(qtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 96)) * rng.uniform(1e-3, 10, (8, 1))).astype(np.float32)
    w[0, :32] = 0  # a block of zeros: d = 0
    raw = gguf.quants.quantize(w, Q[qtype])
    # arbitrary blocks too: every code (Q8_0's -128 included) under random, also negative, scales
    junk = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    junk.reshape(8, 3, -1)[..., :2] = rng.standard_normal((8, 3, 1)).astype(np.float16).view(np.uint8)
    for blocks in (raw, junk):
        qw = transcode(blocks, qtype, 8, 96)
        want = gguf.quants.dequantize(blocks, Q[qtype]).reshape(8, 96)
        np.testing.assert_array_equal(dequantize(qw, _sym(BITS[qtype])), want)
        assert qw.q.shape == (8, 96 * BITS[qtype] // 8) and qw.scales.dtype == np.float32


@pytest.mark.parametrize("bits", [4, 8])
def test_gather_block_quantized_without_zero_points_is_symmetric(bits):
    """What the ort target's embedding relies on: GatherBlockQuantized on uint8 data with no zero
    points takes the midpoint (8 for 4 bits, 128 for 8 bits), so a symmetric weight needs none."""
    rng = np.random.default_rng(bits)
    qtype = "Q4_0" if bits == 4 else "Q8_0"
    n, k = 6, 64
    qw = transcode(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), Q[qtype]), qtype, n, k)
    data = helper.make_tensor("q", TensorProto.UINT8, (n, 2, 32 * bits // 8), qw.q.tobytes(), raw=True)
    scales = onnx.numpy_helper.from_array(qw.scales.reshape(n, 2, 1), "s")
    node = helper.make_node("GatherBlockQuantized", ["q", "ids", "s"], ["y"], domain="com.microsoft", bits=bits,
                            block_size=32, quantize_axis=2, gather_axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [data, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    ids = np.array([4, 0, 4])
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(y.reshape(3, k), dequantize(qw, _sym(bits))[ids])


@pytest.mark.parametrize("block_type,bits,block,keep_q8,want", [
    ("Q4_0", 4, 32, False, 4), ("Q8_0", 8, 32, False, 8),
    ("Q4_0", 8, 32, False, 4),  # smaller and exact
    ("Q8_0", 4, 32, False, None), ("Q8_0", 4, 32, True, 8),  # exact but twice the bytes: only when asked
    ("Q4_0", 4, 64, False, None), ("Q4_1", 4, 32, False, None), (None, 4, 32, False, None)])
def test_which_weights_are_transcoded(block_type, bits, block, keep_q8, want):
    wq = transcoded_as(block_type, QuantConfig(bits=bits, block_size=block, keep_q8=keep_q8))
    assert (wq and wq.bits) == want
    assert wq is None or (wq.symmetric and wq.block_size == 32 and wq.source == "transcoded")


def test_q4_1_transcode_is_bit_exact_with_its_block_minimum():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((8, 96)) * rng.uniform(1e-3, 10, (8, 1)) + rng.uniform(-3, 3, (8, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q4_1)
    qw = transcode(raw, "Q4_1", 8, 96)
    assert qw.mins is not None and qw.mins.shape == (8, 3)
    wq = WeightQuant(4, 32, False, "transcoded", block_min=True)
    np.testing.assert_array_equal(dequantize(qw, wq), gguf.quants.dequantize(raw, Q.Q4_1).reshape(8, 96))


@pytest.mark.parametrize("layout,gathered,symmetric,keep,want", [
    ("nbits", False, False, True, True), ("nbits", False, False, False, False),  # only when asked
    ("qdq", False, False, True, False),  # trt / portable: DequantizeLinear has no minimum
    ("nbits", True, False, True, False),  # a table GatherBlockQuantized reads: no minimum either
    ("nbits", False, True, True, False)])
def test_when_q4_1_is_kept_exact(layout, gathered, symmetric, keep, want):
    cfg = QuantConfig(bits=4, block_size=32, symmetric=symmetric, keep_q4_1=keep)
    wq = transcoded_as("Q4_1", cfg, LAYOUTS[layout], gathered=gathered)
    assert (wq is not None) == want and (wq is None or (wq.block_min and not wq.symmetric))


def test_q4_1_export_matches_gguf_reference(tiny_gguf, tmp_path):
    """ort: every Q4_1 weight exact (block sums x mins in the graph); other targets refuse --keep-q4-1."""
    path = tiny_gguf("llama", "Q4_1")
    cfg = QuantConfig(bits=4, block_size=32, keep_q4_1=True)
    with pytest.raises(DecodertError, match="--keep-q4-1 works on the ort target only"):
        export_model(path, tmp_path / "p", target="portable", max_seq=64, progress=False, quant=cfg)
    export_model(path, tmp_path / "a", target="ort", max_seq=64, progress=False, quant=cfg)
    per_weight = load_manifest(tmp_path / "a").quant.per_weight
    layers = {k: v for k, v in per_weight.items() if k.startswith("layers.")}
    assert layers and all(v.block_min for v in layers.values())
    # the head is Q4_1 too in this tiny file and stays exact; only tests the layers here
    assert _parity(tmp_path / "a", _gguf_model(path)) < TOL


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_checkpoint_blocks_equal_dequantized_tensors(tiny_gguf, family, qtype):
    """Fused parts (q|k|v, gate|up) and llama's un-permuted q/k rows, transcoded, are the float tensors."""
    ckpt = open_checkpoint(tiny_gguf(family, qtype))
    linear = [n for n in ckpt.names() if ckpt.tensor(n).ndim == 2]
    assert linear and all(ckpt.block_type(n) == qtype for n in linear)
    for name in linear:
        np.testing.assert_array_equal(dequantize(ckpt.blocks(name), _sym(BITS[qtype])), ckpt.tensor(name), err_msg=name)
    assert ckpt.block_type("final_norm") is None  # F32


def test_fused_parts_of_different_types_fall_back(tiny_gguf):
    ckpt = open_checkpoint(tiny_gguf("llama", "Q4_0", mixed=True))
    assert ckpt.block_type("layers.0.qkv") is None and ckpt.block_type("layers.1.qkv") == "Q4_0"
    assert open_checkpoint(tiny_gguf("llama", "F32").with_suffix(".hf")).block_type("layers.0.qkv") is None


# -- exported artifacts --------------------------------------------------------------------------------


def _parity(out: Path, model, n_prompts: int = 2) -> float:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 512, n).astype(np.int64) for n in (9, 4)[:n_prompts]]
    return logits_parity(out, [hf_reference(model, p, 9) for p in prompts], prompts, steps=8)


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
@pytest.mark.parametrize("family,qtype,bits,keep_q8", [
    ("llama", "Q4_0", 4, False), ("llama_tied", "Q4_0", 4, False), ("llama_tied", "Q4_0", 8, False),
    ("llama", "Q8_0", 4, True), ("llama_tied", "Q8_0", 8, False)])
def test_transcoded_export_matches_gguf_reference(tiny_gguf, tmp_path, target, family, qtype, bits, keep_q8):
    """Every linear weight (and the tied head, gathered for the embedding on ort) transcoded: the
    artifact computes with exactly the weights transformers dequantizes from the file."""
    path = tiny_gguf(family, qtype)
    cfg = QuantConfig(bits=bits, block_size=32, keep_q8=keep_q8)  # asymmetric asked: transcoded ones are symmetric
    export_model(path, tmp_path / "a", target=target, max_seq=64, progress=False, quant=cfg)
    record = load_manifest(tmp_path / "a").quant
    assert record.bits == bits and "lm_head" in record.weights and set(record.per_weight) == set(record.weights)
    assert {(w.bits, w.block_size, w.symmetric, w.source, w.block_min) for w in record.per_weight.values()} == {
        (BITS[qtype], 32, True, "transcoded", False)}
    assert _parity(tmp_path / "a", _gguf_model(path)) < TOL


def test_mixed_fused_weight_is_requantized_in_the_same_graph(tiny_gguf, tmp_path):
    """layers.0.qkv (Q4_0 q and v, Q8_0 k) is rounded to nearest (asymmetric, as asked); the rest transcoded."""
    path = tiny_gguf("llama", "Q4_0", mixed=True)
    cfg = QuantConfig(bits=4, block_size=32)
    export_model(path, tmp_path / "a", target="ort", max_seq=64, progress=False, quant=cfg)
    per_weight = load_manifest(tmp_path / "a").quant.per_weight
    assert per_weight["layers.0.qkv"] == WeightQuantRecord(bits=4, block_size=32, symmetric=False, source="rtn", block_min=False)
    assert {n for n, w in per_weight.items() if w.source == "rtn"} == {"layers.0.qkv"}
    model = _gguf_model(path)
    attn = model.model.layers[0].self_attn
    w = dequantize(quantize(open_checkpoint(path).tensor("layers.0.qkv"), cfg), cfg)
    q_rows, k_rows = attn.q_proj.out_features, attn.k_proj.out_features
    with torch.no_grad():
        for lin, part in zip((attn.q_proj, attn.k_proj, attn.v_proj), np.split(w, [q_rows, q_rows + k_rows])):
            lin.weight.copy_(torch.from_numpy(part))
    assert _parity(tmp_path / "a", model) < TOL


def test_cli_reports_transcoded_weights(tiny_gguf, tmp_path, capsys):
    path = tiny_gguf("llama", "Q8_0")
    assert cli_main(["export", str(path), "-o", str(tmp_path / "a"), "--max-seq", "32", "--quant", "int4"]) == 0
    assert "quantized 9 weights: 0 transcoded exactly from GGUF blocks, 9 rounded to nearest" in capsys.readouterr().out
    assert cli_main(["export", str(path), "-o", str(tmp_path / "b"), "--max-seq", "32", "--quant", "int4", "--keep-q8"]) == 0
    assert "quantized 9 weights: 9 transcoded exactly" in capsys.readouterr().out
    record = load_manifest(tmp_path / "b").quant
    assert record.keep_q8 and record.bits == 4 and record.per_weight["layers.1.down"].bits == 8


@pytest.mark.trt
def test_trt_builds_mixed_int4_and_int8_weights(tiny_gguf, tmp_path):
    """int8 export of a Q4_0 file: INT4 transcoded weights next to one INT8 rounded one (layers.0.qkv)."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build

    out = tmp_path / "t"
    export_model(tiny_gguf("llama", "Q4_0", mixed=True), out, target="trt", dtype="fp16", max_seq=32, progress=False,
                 quant=QuantConfig(bits=8, block_size=32))
    per_weight = load_manifest(out).quant.per_weight
    assert per_weight["layers.0.qkv"].bits == 8 and per_weight["layers.0.o"].bits == 4
    kinds = {t.name: t.data_type for t in onnx.load(out / "decode.onnx", load_external_data=False).graph.initializer}
    assert kinds["layers.0.qkv.q"] == TensorProto.INT8 and kinds["layers.0.o.q"] == TensorProto.INT4
    engines = trt_build.build_engines(out, progress=False)
    assert engines["decode"].layers["DEQUANTIZE"] >= 9
