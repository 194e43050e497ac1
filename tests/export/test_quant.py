"""Weight-only int4/int8: the packing, and every target against transformers running the same
dequantized weights (so the comparison is exact, not 'close enough for int4')."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import transformers

from decodert.cli import main as cli_main
from decodert.artifact.manifest import load_manifest
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import QuantConfig, dequantize, pack_nibbles, quantize, unpack_nibbles
from parity import hf_reference, logits_parity

TOL = 1e-4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("block", [16, 32, 128])
def test_quantize_roundtrip_error_within_half_a_step(bits, symmetric, block):
    rng = np.random.default_rng(bits * 100 + block)
    w = rng.standard_normal((24, 200)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1)).astype(np.float32)
    cfg = QuantConfig(bits=bits, block_size=block, symmetric=symmetric, scale_search=False)  # min/max grid
    qw = quantize(w, cfg)
    back = dequantize(qw, cfg)
    assert back.shape == w.shape
    step = np.repeat(qw.scales, block, axis=1)[:, : w.shape[1]]
    assert (np.abs(back - w) <= step * 0.5 + 1e-6).all()
    assert qw.q.shape == (24, qw.blocks * block * bits // 8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_scale_search_never_worse_than_min_max_per_block(bits, symmetric):
    rng = np.random.default_rng(bits + 7 * symmetric)
    w = rng.standard_t(3, (64, 256)).astype(np.float32) * 0.05  # heavy tails: outliers stretch min/max
    errs = []
    for search in (False, True):
        cfg = QuantConfig(bits=bits, block_size=32, symmetric=symmetric, scale_search=search)
        errs.append(((dequantize(quantize(w, cfg), cfg) - w) ** 2).reshape(64, 8, 32).sum(-1))
    assert (errs[1] <= errs[0] * (1 + 1e-5) + 1e-12).all()
    assert errs[1].sum() < 0.99 * errs[0].sum()  # and better overall (here by 2-16%)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False)])
def test_quantize_in_chunks_equals_row_by_row(monkeypatch, bits, symmetric):
    """quantize works through the weight a few rows at a time (to stay in the CPU's cache): every row must
    come out as if it were quantized alone, whatever the chunk boundaries (here 3 rows, leaving a remainder)."""
    from decodert.export.quantize import quant

    rng = np.random.default_rng(7)
    w = rng.standard_normal((10, 70), dtype=np.float32)  # 70 -> 3 blocks of 32, padded
    cfg = QuantConfig(bits=bits, symmetric=symmetric)
    monkeypatch.setattr(quant, "CHUNK_VALUES", 3 * 96)
    whole = quantize(w, cfg)
    rows = [quantize(w[i:i + 1], cfg) for i in range(len(w))]
    for field in ("q", "scales", "zero_points"):
        assert np.array_equal(getattr(whole, field), np.concatenate([getattr(r, field) for r in rows])), field


def test_nibble_packing_low_first():
    v = np.array([[1, 2, 15, 0]], np.uint8)
    packed = pack_nibbles(v)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert (unpack_nibbles(packed) == v).all()


def _dequantized_hf_model(src, cfg: QuantConfig, target: str):
    """The transformers model with every quantized weight replaced by what the artifact stores.

    A tied head on the ort target is stored once, quantized, and the embedding rows are gathered
    from it (GatherBlockQuantized); elsewhere the embedding stays float and the head is a copy.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
                lin.weight.copy_(torch.from_numpy(dequantize(quantize(lin.weight.numpy(), cfg), cfg)))
        if cfg.lm_head:
            w = torch.from_numpy(dequantize(quantize(model.lm_head.weight.detach().numpy(), cfg), cfg))
            if model.config.tie_word_embeddings and target == "ort":
                model.lm_head.weight.copy_(w)  # the shared parameter: embedding and head both change
            else:
                model.lm_head.weight = torch.nn.Parameter(w)  # unties a tied head
    return model


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
@pytest.mark.parametrize("family,bits,block,symmetric", [
    ("llama", 4, 32, False), ("llama_tied", 4, 16, True), ("llama_tied", 4, 32, False), ("llama_tied", 8, 32, True),
    ("qwen2", 8, 32, False), ("llama3", 4, 128, False)])
def test_quantized_export_matches_dequantized_reference(tiny_checkpoint, tmp_path, target, family, bits, block, symmetric):
    src = tiny_checkpoint(family)
    cfg = QuantConfig(bits=bits, block_size=block, symmetric=symmetric or target == "trt")
    out = tmp_path / "q"
    export_model(src, out, target=target, max_seq=64, progress=False, quant=cfg)
    m = load_manifest(out)
    assert m.quant.bits == bits and "lm_head" in m.quant.weights
    tied_gather = family == "llama_tied" and target == "ort"
    graph = onnx.load(out / "decode.onnx", load_external_data=False).graph
    assert any(n.op_type == "GatherBlockQuantized" for n in graph.node) == tied_gather
    assert ("embed" in {t.name for t in graph.initializer}) != tied_gather  # no float table kept
    model = _dequantized_hf_model(src, cfg, target)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 512, n).astype(np.int64) for n in (9, 4)]
    refs = [hf_reference(model, p, 9) for p in prompts]
    assert logits_parity(out, refs, prompts, steps=8) < TOL


def test_int4_artifact_is_smaller_and_cli_validates(tiny_checkpoint, tmp_path, capsys):
    src = tiny_checkpoint("llama")
    assert cli_main(["export", str(src), "-o", str(tmp_path / "f"), "--max-seq", "32"]) == 0
    assert cli_main(["export", str(src), "-o", str(tmp_path / "q"), "--max-seq", "32", "--quant", "int4"]) == 0
    full, q4 = (load_manifest(tmp_path / n).weights.bytes for n in ("f", "q"))
    assert q4 < 0.5 * full  # the fp32 embedding (a quarter of this tiny model) stays float
    assert cli_main(["export", str(src), "-o", str(tmp_path / "x"), "--quant", "int4", "--block-size", "48"]) == 2
    assert "block-size" in capsys.readouterr().err
