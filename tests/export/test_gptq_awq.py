"""GPTQ and AWQ checkpoints transcoded exactly (export/quantize/quant_packed.py).

Each test quantizes a tiny random llama here, in numpy (a known grid per group: fp16 scales, 4-bit
codes, zeros; act-order as a random input permutation), packs it the way AutoGPTQ / GPTQModel and
AutoAWQ write it (int32 words of eight nibbles; GPTQ along the inputs with zeros - 1 and g_idx, AWQ
along the outputs in its interleaved order), and checks: every transcoded weight dequantizes to the
reference bit for bit, and the artifact's logits match transformers running the dequantized float
checkpoint (MatMulNBits on ort, block DequantizeLinear on portable / trt).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.export.pipeline import export_model
from decodert.export.quantize.quant import dequantize
from decodert.export.quantize.quant_packed import AWQ_ORDER

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values < 16 -> int32 words, value j in bits 4j..4j+3."""
    w = (nibbles.astype(np.uint64) << (4 * np.arange(8, dtype=np.uint64))).sum(-1)
    return w.astype(np.uint32).view(np.int32)


def _quantize(w: np.ndarray, group: int, g_idx: np.ndarray, symmetric: bool, rng) -> tuple:
    """A known 4-bit grid per (output, group) -> (q [N,K], zeros [N,G], fp16 scales [N,G], dequantized [N,K])."""
    n, k = w.shape
    groups = k // group
    lo = np.stack([w[:, g_idx == g].min(1) for g in range(groups)], 1)
    hi = np.stack([w[:, g_idx == g].max(1) for g in range(groups)], 1)
    if symmetric:
        scales = (np.maximum(-lo, hi) / 7.5).astype(np.float16)
        zeros = np.full((n, groups), 8)
    else:
        scales = ((hi - lo) / 15).astype(np.float16)
        zeros = np.clip(np.round(-lo / scales.astype(np.float32)), 1, 15).astype(np.int64)  # >= 1: GPTQ stores zero - 1
    s = scales.astype(np.float32)
    q = np.clip(np.round(w / s[:, g_idx]) + zeros[:, g_idx], 0, 15).astype(np.uint8)
    return q, zeros, scales, (q.astype(np.float32) - zeros[:, g_idx]) * s[:, g_idx]


def _pack(method: str, q, zeros, scales, g_idx, gptq_v2: bool) -> dict[str, np.ndarray]:
    n, k = q.shape
    if method == "gptq":
        stored = zeros if gptq_v2 else zeros - 1
        out = {"qweight": _words(q.T.reshape(k // 8, 8, n).transpose(0, 2, 1)),
               "qzeros": _words(stored.T.reshape(-1, n // 8, 8)), "g_idx": g_idx.astype(np.int32)}
    else:  # output 8i + AWQ_ORDER[j] in nibble j
        out = {"qweight": _words(q.T.reshape(k, n // 8, 8)[..., AWQ_ORDER]),
               "qzeros": _words(zeros.T.reshape(-1, n // 8, 8)[..., AWQ_ORDER])}
    return {**out, "scales": scales.T.copy()}


def _input_of(key: str) -> str:
    """Linears reading the same input share an act-order (GPTQ orders inputs by the same Hessian)."""
    layer = key.split(".self_attn.")[0].split(".mlp.")[0]
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return layer + "/" + shared.get(key.rsplit(".", 2)[-2], key)


def make_packed(src: Path, out: Path, method: str, group: int, symmetric: bool, act_order: bool,
                gptq_v2: bool = False, seed: int = 0, shared_order: bool = True) -> tuple[Path, Path]:
    """(the GPTQ / AWQ checkpoint, the same model with its dequantized weights in float)."""
    rng = np.random.default_rng(seed)
    orders: dict[str, np.ndarray] = {}
    tensors = {k: v.numpy() for k, v in safetensors_torch.load_file(str(src / "model.safetensors")).items()}
    packed, ref = {}, dict(tensors)
    for key, w in tensors.items():
        if not key.endswith(".weight") or not any(f".{m}." in key for m in LINEARS):
            packed[key] = w
            continue
        k = w.shape[1]
        order = np.arange(k)
        if act_order:
            order = orders.setdefault(_input_of(key) if shared_order else key, rng.permutation(k))
        g_idx = np.empty(k, np.int64)
        g_idx[order] = np.arange(k) // group  # act-order: the permuted inputs fill the groups in turn
        q, zeros, scales, deq = _quantize(w, group, g_idx, symmetric, rng)
        ref[key] = deq
        base = key[: -len("weight")]
        packed.update({base + name: t for name, t in _pack(method, q, zeros, scales, g_idx, gptq_v2).items()})
    qdir, rdir = out / method, out / "reference"
    for folder, data in ((qdir, packed), (rdir, ref)):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
        safetensors_torch.save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.items()},
                                    str(folder / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq_v2" if gptq_v2 else "gptq"}
              if method == "gptq" else {"version": "gemm", "zero_point": True})
    config["quantization_config"] = qc
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, rdir


CASES = {  # id -> (method, group, symmetric, act_order, gptq_v2, hidden)
    "gptq-g32-actorder-zeros": ("gptq", 32, False, True, False, 64),
    "gptq-g64-sym": ("gptq", 64, True, False, False, 64),
    "gptq-g128-actorder-sym-v2": ("gptq", 128, True, True, True, 256),
    "awq-g32": ("awq", 32, False, False, False, 64),
    "awq-g128": ("awq", 128, False, False, False, 128),
}


@pytest.fixture(scope="module")
def packed_pair(tiny_checkpoint, tmp_path_factory):
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            method, group, sym, act, v2, hidden = CASES[case]
            src = tiny_checkpoint("llama", hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4)
            made[case] = make_packed(src, tmp_path_factory.mktemp(case), method, group, sym, act, v2)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_transcoded_weights_equal_the_reference_bit_for_bit(packed_pair, case):
    qdir, rdir = packed_pair(case)
    q, r = open_checkpoint(qdir), open_checkpoint(rdir)
    method, group, sym, act, _, _ = CASES[case]
    for name in q.names():
        if name.rsplit(".", 1)[-1] not in ("qkv", "o", "gate_up", "down"):
            continue
        qw, wq = q.packed(name)
        assert (wq.bits, wq.block_size, wq.symmetric, wq.source, wq.act_order) == (4, group, sym, method, act)
        ref = r.tensor(name)
        np.testing.assert_array_equal(dequantize(qw, wq), ref)
        np.testing.assert_array_equal(q.tensor(name), ref)  # the float read of the packed weight
    assert q.native_quant().block_size == group and not q.native_quant().lm_head


def _hf_logits(folder: Path, ids: list[int], steps: int = 6) -> tuple[list[int], np.ndarray]:
    from transformers import AutoModelForCausalLM

    import parity

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return parity.hf_reference(model, np.array(ids), steps)


@pytest.mark.parametrize("case,target", [("gptq-g32-actorder-zeros", "ort"), ("gptq-g32-actorder-zeros", "portable"),
                                         ("gptq-g64-sym", "trt"), ("gptq-g128-actorder-sym-v2", "ort"),
                                         ("gptq-g128-actorder-sym-v2", "trt"), ("awq-g32", "ort"),
                                         ("awq-g128", "portable")])
def test_logits_match_the_dequantized_reference(packed_pair, case, target, tmp_path):
    import parity

    qdir, rdir = packed_pair(case)
    out = tmp_path / "art"
    m = export_model(qdir, out, target=target, max_seq=64, max_batch=1, progress=False)
    per_weight = m.quant.per_weight
    assert {w.source for w in per_weight.values()} == {CASES[case][0]} and "lm_head" not in per_weight
    assert all(w.act_order == CASES[case][3] for w in per_weight.values())
    prompt = [5, 17, 99, 3, 250, 41, 7]
    ref = _hf_logits(rdir, prompt)
    assert parity.logits_parity(out, [ref], [np.array(prompt, np.int64)], steps=5) < 1e-4


def test_trt_target_refuses_zero_points(packed_pair, tmp_path):
    qdir, _ = packed_pair("awq-g32")
    with pytest.raises(DecodertError, match="zero points.*--target ort or portable") as e:
        export_model(qdir, tmp_path / "x", target="trt", max_seq=32, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "gptq with 3 bits is not supported"),
    ({"group_size": 256}, "group_size 256 is not supported"),
    ({"group_size": -1}, "group_size -1 is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
])
def test_unsupported_quantization_refused_in_one_line(packed_pair, tmp_path, change, message):
    qdir, _ = packed_pair("gptq-g64-sym")
    bad = shutil.copytree(qdir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match=message) as e:
        export_model(bad, tmp_path / "x", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


def test_awq_gemv_refused(packed_pair, tmp_path):
    qdir, _ = packed_pair("awq-g32")
    bad = shutil.copytree(qdir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match="awq version 'gemv'"):
        open_checkpoint(bad)


def test_fused_parts_with_different_act_orders_refused(tiny_checkpoint, tmp_path):
    qdir, _ = make_packed(tiny_checkpoint("llama"), tmp_path, "gptq", 32, False, True, shared_order=False)
    with pytest.raises(DecodertError, match="different act-order g_idx") as e:
        export_model(qdir, tmp_path / "x", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


@pytest.mark.trt
def test_act_order_gptq_builds_on_tensorrt_rtx(packed_pair, tmp_path):
    """The trt target's act-order weights (a Gather of the inputs, then int4 block DequantizeLinear) build."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    from decodert.export import trt_build

    qdir, _ = packed_pair("gptq-g128-actorder-sym-v2")
    export_model(qdir, tmp_path / "art", target="trt", dtype="fp16", max_seq=64, max_batch=1, progress=False)
    engines = trt_build.build_engines(tmp_path / "art", progress=False)
    assert {"prefill", "decode"} <= set(engines)


def test_run_keeps_a_gptq_checkpoint_as_it_is(packed_pair):
    """What `decodert run` / LLM.load of the folder exports: the checkpoint's blocks, said so."""
    from decodert.export.checkpoints.source_precision import keep_precision

    qdir, rdir = packed_pair("gptq-g64-sym")
    quant, about = keep_precision(open_checkpoint(qdir))
    assert quant is not None and quant.block_size == 64 and about == "int4: GPTQ blocks transcoded exactly"
    assert keep_precision(open_checkpoint(rdir))[0] is None


# -- damaged packed tensors and settings: refused in one line, naming the tensor (issue 45: 6, 7, 18, 20) ------------
Q = "model.layers.0.self_attn.q_proj."


def _rewritten(qdir: Path, out: Path, change=None, config=None) -> Path:
    """A copy of ``qdir`` with ``change(tensors)`` applied to its tensors and ``config(cfg)`` to its config.json."""
    from safetensors.numpy import load_file, save_file

    bad = shutil.copytree(qdir, out)
    if change is not None:
        tensors = load_file(str(bad / "model.safetensors"))
        change(tensors)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(bad / "model.safetensors"))
    if config is not None:
        cfg = json.loads((bad / "config.json").read_text())
        config(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def _set(key: str, make):
    def change(t: dict) -> None:
        t[key] = make(t[key])
    return change


def _nan_at(value: float):
    def make(s: np.ndarray) -> np.ndarray:
        s = s.copy()
        s.flat[3] = value
        return s
    return make


DAMAGED = {  # id -> (change, the message's parts)
    "qweight-float32": (_set(Q + "qweight", lambda w: w.astype(np.float32)), ["qweight", "must be 2-D I32", "found F32"]),
    "qweight-int64": (_set(Q + "qweight", lambda w: w.astype(np.int64)), ["qweight", "must be 2-D I32", "found I64"]),
    "qzeros-float16": (_set(Q + "qzeros", lambda w: (w % 1000).astype(np.float16)), ["qzeros", "found F16"]),
    "g_idx-float32": (_set(Q + "g_idx", lambda w: w.astype(np.float32)), ["g_idx", "found F32"]),
    "scales-int32": (_set(Q + "scales", lambda w: w.astype(np.int32)), ["scales", "F16 / BF16 / F32", "found I32"]),
    "scales-nan": (_set(Q + "scales", _nan_at(np.nan)), ["scales", "NaN, infinite or too large"]),
    "scales-inf": (_set(Q + "scales", _nan_at(np.inf)), ["scales", "NaN, infinite or too large"]),
    "scales-huge-f32": (_set(Q + "scales", lambda s: _nan_at(3e38)(s.astype(np.float32))), ["scales", "too large"]),
    "qzeros-shape": (_set(Q + "qzeros", lambda w: w[:, :-1]), ["qzeros", "must be I32 [2, 8]", "found I32 [2, 7]"]),
    "scales-shape": (_set(Q + "scales", lambda w: w[:-1]), ["scales", "found F16 [1, 64]"]),
    "scales-outputs": (_set(Q + "scales", lambda w: w[:, :-3]), ["scales", "not a multiple of the 8"]),
    "qweight-shape": (_set(Q + "qweight", lambda w: w[:, :-8]), ["qweight", "found I32 [8, 56]"]),
    "g_idx-shape": (_set(Q + "g_idx", lambda w: w[:-1]), ["g_idx", "must be I32 [64]"]),
    "g_idx-range": (_set(Q + "g_idx", lambda w: np.where(np.arange(w.size) == 5, 7, w).astype(np.int32)), ["g_idx", "group 7"]),
    "qzeros-missing": (lambda t: t.pop(Q + "qzeros"), ["qweight", "has no qzeros"]),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_packed_tensors_refused_in_one_line(packed_pair, tmp_path, case, capsys):
    from decodert.cli import main as cli_main

    change, parts = DAMAGED[case]
    bad = _rewritten(packed_pair("gptq-g32-actorder-zeros")[0], tmp_path / "bad", change)
    capsys.readouterr()  # the fixture's own output
    assert cli_main(["export", str(bad), "-o", str(tmp_path / "x"), "--max-seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(p in err for p in parts), err
    assert not (tmp_path / "x").exists()


def test_a_float_checkpoint_claiming_gptq_is_refused(packed_pair, tmp_path):
    _, rdir = packed_pair("gptq-g64-sym")
    bad = _rewritten(rdir, tmp_path / "bad", config=lambda c: c.update(
        quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 64}))
    with pytest.raises(DecodertError, match="says gptq, but the checkpoint holds no qweight tensors") as e:
        export_model(bad, tmp_path / "x", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("qc,message", [
    ("gptq", "quantization_config must be an object (quant_method, bits, group_size), got the string 'gptq'"),
    ([4], "quantization_config must be an object"),
    ({"quant_method": "gptq", "bits": "4", "group_size": 64}, "quantization_config.bits must be an integer, got the string '4'"),
    ({"quant_method": "gptq", "bits": 4.0, "group_size": 64}, "bits must be an integer, got the number 4.0"),
    ({"quant_method": "gptq", "bits": True, "group_size": 64}, "bits must be an integer, got true"),
    ({"quant_method": "gptq", "group_size": 64}, "bits must be an integer, got null"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64.0}, "group_size must be an integer, got the number 64.0"),
    ({"quant_method": ["gptq"], "bits": 4, "group_size": 64}, "quant_method ['gptq'] is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": 2}, "checkpoint_format must be a string"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": "yes"}, "zero_point must be true or false"),
])
def test_bad_quantization_settings_are_exit_2_in_one_line(packed_pair, tmp_path, qc, message, capsys):
    from decodert.cli import main as cli_main

    bad = _rewritten(packed_pair("gptq-g64-sym")[0], tmp_path / "bad", config=lambda c: c.update(quantization_config=qc))
    capsys.readouterr()
    assert cli_main(["export", str(bad), "-o", str(tmp_path / "x"), "--max-seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
