"""The standing guard over quantized checkpoint tensors (issue 45: 6, 7, 18): for every quantized layout the
exporter reads -- GPTQ and AWQ packed int32 words (export/quantize/quant_packed.py), GGUF Q4_0 / Q8_0 /
Q4_1 blocks (export/quantize/quant_gguf.py) and MXFP4 experts (export/quantize/mxfp4.py) -- a checkpoint whose tensors have any dtype, shape or values
(NaN, inf, huge scales, zero points past 4 bits, groups out of range, a changed GGUF type or dims) is

    read exactly: what the export stores (the transcoded weight) and the float read both equal the layout's
                  numpy reference below, written from the format's definition (never decodert's code); or
    refused in one line: a DecodertError, no other exception, no traceback.

An undamaged checkpoint must be read. The tiny checkpoints are made once per module; each example writes one
damaged copy (a safetensors file written here, or a GGUF patched in place), so the whole file runs in seconds.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tiny import make_tiny_gguf

from decodert.errors import DecodertError
from decodert.export.checkpoints.checkpoint_open import open_checkpoint
from decodert.export.quantize.quant import QuantConfig, dequantize
from decodert.export.quantize.quant_gguf import transcoded_as

gguf = pytest.importorskip("gguf")

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds output 8i + AWQ_ORDER[j]
NP = {"I32": np.int32, "I64": np.int64, "F32": np.float32, "F16": np.float16, "F64": np.float64, "U8": np.uint8,
      "BF16": np.uint16}
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# canonical weight -> its parts: (HF module, GGUF tensor)
PARTS = {"qkv": [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v")],
         "o": [("self_attn.o_proj", "attn_output")], "gate_up": [("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up")],
         "down": [("mlp.down_proj", "ffn_down")]}
NAMES = [f"layers.{i}.{w}" for i in range(2) for w in PARTS]


def _one_line(e: DecodertError) -> None:
    assert "\n" not in str(e) and str(e), repr(e)


def _read(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray | None]] | None:
    """canonical name -> (float read, the stored quantized weight dequantized or None), or None when refused."""
    try:
        ckpt = open_checkpoint(folder)
        out = {}
        for name in NAMES:
            stored = None
            packed = ckpt.packed(name)
            if packed is not None:
                stored = dequantize(*packed)
            elif ckpt.block_type(name) is not None:
                kind = ckpt.block_type(name)
                wq = transcoded_as(kind, QuantConfig(bits=8, block_size=32, keep_q8=True, keep_q4_1=True))
                assert wq is not None, kind
                stored = dequantize(ckpt.blocks(name), wq)
            out[name] = (ckpt.tensor(name), stored)
        ckpt.close()
        return out
    except DecodertError as e:
        _one_line(e)
        return None


def _check(got, reference: dict[str, np.ndarray | None], packed: bool, damaged: bool) -> None:
    """``got`` (``_read``) equals the reference of every weight it read; an undamaged checkpoint is read."""
    if got is None:
        assert damaged, "an undamaged checkpoint was refused"
        return
    for name, (tensor, stored) in got.items():
        ref = reference[name]
        assert ref is not None, f"{name}: read although its tensors are not a valid layout"
        np.testing.assert_array_equal(tensor, ref, err_msg=name)
        if packed:
            assert stored is not None, name
        if stored is not None:
            np.testing.assert_array_equal(stored, ref, err_msg=name)


# -- GPTQ / AWQ: the layout, written and read from its definition ----------------------------------------------------
def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values < 16 -> int32 words, value j in bits 4j..4j+3."""
    w = (nibbles.astype(np.uint64) << (4 * np.arange(8, dtype=np.uint64))).sum(-1)
    return w.astype(np.uint32).view(np.int32)


def _nibbles(words: np.ndarray) -> np.ndarray:
    u = words.view(np.uint32).astype(np.uint64)
    return ((u[..., None] >> (4 * np.arange(8, dtype=np.uint64))) & 15).astype(np.int64)


def _float(dtype: str, a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else a.astype(np.float32)


def packed_reference(method: str, t: dict[str, tuple[str, np.ndarray]], n: int, k: int) -> np.ndarray | None:
    """The float32 [N, K] weight one GPTQ (v1: zeros stored minus 1) / AWQ linear stands for, or None
    when its tensors are not that layout (a dtype, a shape, a value the format does not have)."""
    g = -(-k // GROUP)
    shapes = {"qweight": (k // 8, n) if method == "gptq" else (k, n // 8), "qzeros": (g, n // 8), "scales": (g, n),
              "g_idx": (k,)}
    dtypes = {"qweight": ("I32",), "qzeros": ("I32",), "scales": ("F16", "BF16", "F32"), "g_idx": ("I32",)}
    if not {"qweight", "qzeros", "scales"} <= set(t) or (method == "awq" and "g_idx" in t) or n % 8 or k % 8:
        return None
    if any(d not in dtypes[s] or a.shape != shapes[s] for s, (d, a) in t.items()):
        return None
    scales = _float(*t["scales"])
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(scales * np.float32(15)).all():
            return None
    if method == "gptq":
        q = _nibbles(t["qweight"][1]).transpose(0, 2, 1).reshape(k, n)  # word (i, n) holds inputs 8i..8i+7
        zeros = _nibbles(t["qzeros"][1]).reshape(g, n) + 1
        g_idx = t["g_idx"][1].astype(np.int64) if "g_idx" in t else np.arange(k) // GROUP
    else:
        q = np.empty((k, n), np.int64)
        zeros = np.empty((g, n), np.int64)
        for j, c in enumerate(AWQ_ORDER):
            q[:, c::8] = _nibbles(t["qweight"][1])[..., j]
            zeros[:, c::8] = _nibbles(t["qzeros"][1])[..., j]
        g_idx = np.arange(k) // GROUP
    if zeros.max() > 15 or g_idx.min() < 0 or g_idx.max() >= g:
        return None
    return np.ascontiguousarray(((q - zeros[g_idx]).astype(np.float32) * scales[g_idx]).T)


def _pack(method: str, n: int, k: int, order: np.ndarray, rng) -> dict[str, tuple[str, np.ndarray]]:
    """Random valid tensors of one [N, K] linear (act-order ``order`` for GPTQ)."""
    g = k // GROUP
    q = rng.integers(0, 16, (k, n))
    zeros = rng.integers(1, 16, (g, n))  # GPTQ v1 stores zero - 1 >= 0
    scales = rng.uniform(1e-3, 0.1, (g, n)).astype(np.float16)
    if method == "gptq":
        g_idx = np.empty(k, np.int32)
        g_idx[order] = np.arange(k) // GROUP
        return {"qweight": ("I32", _words(q.reshape(k // 8, 8, n).transpose(0, 2, 1))),
                "qzeros": ("I32", _words((zeros - 1).reshape(g, n // 8, 8))), "scales": ("F16", scales),
                "g_idx": ("I32", g_idx)}
    return {"qweight": ("I32", _words(q.reshape(k, n // 8, 8)[..., AWQ_ORDER])),
            "qzeros": ("I32", _words(zeros.reshape(g, n // 8, 8)[..., AWQ_ORDER])), "scales": ("F16", scales)}


def save_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file of (dtype name, array) per key, any dtype the format names (BF16: uint16 bits)."""
    header, blobs, at = {}, [], 0
    for key, (dtype, a) in tensors.items():
        data = np.ascontiguousarray(a.astype(NP[dtype], copy=False)).tobytes()
        header[key] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


@pytest.fixture(scope="module")
def packed_checkpoints(tiny_checkpoint, tmp_path_factory):
    """method -> (folder with config.json + tokenizer, its tensors, linear base -> (N, K)), made once."""
    from safetensors.numpy import load_file

    src = tiny_checkpoint("llama")
    floats = {k: ("F32", v.astype(np.float32)) for k, v in load_file(str(src / "model.safetensors")).items()}
    made = {}
    for method in ("gptq", "awq"):
        rng = np.random.default_rng(45)
        tensors, sizes = dict(floats), {}
        for i in range(2):
            orders = {}
            for parts in PARTS.values():
                for module, _ in parts:
                    key = f"model.layers.{i}.{module}.weight"
                    n, k = tensors.pop(key)[1].shape
                    shared = "qkv" if "self_attn" in module and "o_proj" not in module else module
                    shared = "gate_up" if module in ("mlp.gate_proj", "mlp.up_proj") else shared
                    order = orders.setdefault(shared, rng.permutation(k))  # fused parts share an act-order
                    base = key[: -len("weight")]
                    sizes[base] = (n, k)
                    tensors.update({base + s: v for s, v in _pack(method, n, k, order, rng).items()})
        folder = tmp_path_factory.mktemp(method)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": GROUP,
                                         **({"desc_act": True, "checkpoint_format": "gptq"} if method == "gptq"
                                            else {"version": "gemm", "zero_point": True})}
        (folder / "config.json").write_text(json.dumps(config))
        made[method] = (folder, tensors, sizes)
    return made


def _redtype(dtype: str, a: np.ndarray, new: str) -> tuple[str, np.ndarray]:
    with np.errstate(over="ignore", invalid="ignore"):
        f = _float(dtype, a) if dtype in ("F16", "BF16", "F32", "F64") else a
        if new == "BF16":
            return new, (np.asarray(f, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return new, np.asarray(f).astype(NP[new])


def _reshape(a: np.ndarray, how: str) -> np.ndarray:
    if how == "drop-row":
        return a[:-1]
    if how == "add-row":
        return np.concatenate([a, a[:1]])
    if how == "flatten":
        return a.reshape(-1)
    if how == "add-dim":
        return a[None]
    if a.ndim < 2:
        return a[1:]
    return {"drop-col": lambda: a[:, :-1], "add-col": lambda: np.concatenate([a, a[:, :1]], axis=1),
            "transpose": lambda: a.T}[how]()


def _damaged(data, tensors: dict, key: str, kind: str, write) -> dict:
    """A copy of ``tensors`` with ``tensors[key]`` damaged by ``kind``: "missing", "dtype" (another stored dtype),
    "shape" (a drawn reshape) or "values" (``write(dtype, a, at) -> (dtype, a)`` writes into a copy at drawn places)."""
    out = dict(tensors)
    dtype, a = out[key]
    if kind == "missing":
        del out[key]
    elif kind == "dtype":
        out[key] = _redtype(dtype, a, data.draw(st.sampled_from([d for d in NP if d != dtype]), label="dtype"))
    elif kind == "shape":
        out[key] = (dtype, _reshape(a, data.draw(st.sampled_from(
            ["drop-row", "add-row", "drop-col", "add-col", "transpose", "flatten", "add-dim"]), label="shape")))
    else:
        a = a.copy()
        out[key] = write(dtype, a, data.draw(st.lists(st.integers(0, a.size - 1), min_size=1, max_size=3), label="at"))
    return out


def _damage_packed(data, tensors: dict, bases: list[str]) -> tuple[dict, bool]:
    """A copy of ``tensors`` with one packed tensor damaged as hypothesis draws it; (tensors, damaged?)."""
    kind = data.draw(st.sampled_from(["none", "dtype", "shape", "values", "values", "missing"]), label="kind")
    if kind == "none":
        return tensors, False
    base = data.draw(st.sampled_from(bases), label="linear")
    key = base + data.draw(st.sampled_from([s for s in ("qweight", "qzeros", "scales", "g_idx") if base + s in tensors]),
                           label="tensor")

    def write(dtype: str, a: np.ndarray, at: list[int]) -> tuple[str, np.ndarray]:
        if key.endswith("scales"):
            value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.05, 6e4, 3e38]), label="value")
            if value == 3e38:
                dtype, a = "F32", a.astype(np.float32)  # finite in float32, but 15x overflows
            with np.errstate(over="ignore"):
                a.flat[at] = value
        elif key.endswith("g_idx"):
            a.flat[at] = data.draw(st.integers(-3, a.size // GROUP + 3), label="group")
        else:
            a.flat[at] = data.draw(st.integers(-2**31, 2**31 - 1), label="word")
        return dtype, a

    out = _damaged(data, tensors, key, kind, write)
    return out, True


@pytest.mark.parametrize("method", ["gptq", "awq"])
@SETTINGS
@given(data=st.data())
def test_packed_tensors_are_read_exactly_or_refused_in_one_line(packed_checkpoints, tmp_path_factory, method, data):
    folder, tensors, sizes = packed_checkpoints[method]
    damaged, changed = _damage_packed(data, tensors, sorted(sizes))
    copy = tmp_path_factory.mktemp("case")
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    save_safetensors(copy / "model.safetensors", damaged)
    parts = {base: packed_reference(method, {s: damaged[base + s] for s in ("qweight", "qzeros", "scales", "g_idx")
                                             if base + s in damaged}, *sizes[base]) for base in sizes}
    reference = {}
    for name in NAMES:
        i, w = name.split(".")[1:]
        refs = [parts[f"model.layers.{i}.{module}."] for module, _ in PARTS[w]]
        reference[name] = None if any(r is None for r in refs) else np.concatenate(refs)
    _check(_read(copy), reference, packed=True, damaged=changed)
    shutil.rmtree(copy)


# -- GGUF blocks ---------------------------------------------------------------------------------------------------
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34, "Q4_1": 20}
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
F16_BITS = [0x7E00, 0x7C00, 0xFC00, 0x7BFF, 0x0000, 0x8000, 0x3C00]  # NaN, inf, -inf, 65504, 0, -0, 1


def _blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """Random valid blocks of an [N, K] weight: uint8 [N, K/32 * block bytes]."""
    b = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=np.uint8)
    heads = 2 if kind == "Q4_1" else 1
    d = rng.uniform(1e-3, 0.1, (n, k // 32, heads)).astype(np.float16)
    b[..., : 2 * heads] = d.view(np.uint8).reshape(n, k // 32, 2 * heads)
    return b.reshape(n, -1)


def gguf_reference(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray | None:
    """The float32 [N, K] weight of GGUF blocks (the ggml definitions), None when a scale is not finite."""
    if kind not in BLOCK_BYTES:  # another type (F32, a K-quant): the gguf package is the reference
        return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(n, k)
    b = raw.reshape(n, k // 32, BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    if kind == "Q8_0":
        w = d * b[..., 2:].copy().view(np.int8).astype(np.float32)
    else:
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)  # value j < 16 low, j + 16 high nibble
        if kind == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
            if not np.isfinite(m).all():
                return None
            w = d * q + m
        else:
            w = d * (q - 8)
    return None if not np.isfinite(d).all() else w.reshape(n, k)


@pytest.fixture(scope="module")
def gguf_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A qwen2 GGUF (no row reorder on q/k) with Q4_0, Q8_0 and Q4_1 linears of random valid blocks."""
    hf = tiny_checkpoint("qwen2")
    cfg = json.loads((hf / "config.json").read_text())
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    shapes = {"attn_q": (cfg["num_attention_heads"] * hd, h), "attn_k": (cfg["num_key_value_heads"] * hd, h),
              "attn_v": (cfg["num_key_value_heads"] * hd, h), "attn_output": (h, h), "ffn_gate": (inter, h),
              "ffn_up": (inter, h), "ffn_down": (h, inter)}
    rng = np.random.default_rng(45)
    raw = {f"blk.{i}.{t}.weight": (TYPES[t], _blocks(TYPES[t], *shapes[t], rng)) for i in range(2) for t in TYPES}
    path = make_tiny_gguf("qwen2", tmp_path_factory.mktemp("gguf") / "q.gguf", raw=raw, hf_dir=hf)
    return path, {f"blk.{i}.{t}.weight": shapes[t] for i in range(2) for t in TYPES}


def _damage_gguf(data, path: Path, names: list[str]) -> bool:
    """Damage one linear of the GGUF at ``path`` in place (its blocks' scales, its type or its dims); damaged?"""
    kind = data.draw(st.sampled_from(["none", "values", "values", "type", "dims"]), label="kind")
    if kind == "none":
        return False
    name = data.draw(st.sampled_from(names), label="tensor")
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == name)
    if kind == "type":
        t.field.parts[4][0] = data.draw(st.sampled_from([0, 1, 2, 3, 8, 12, 14, 30, 99]), label="ggml type")
    elif kind == "dims":
        dims = t.field.parts[3]
        j = data.draw(st.integers(0, len(dims) - 1), label="dim")
        dims[j] = data.draw(st.sampled_from([int(dims[j]) + 32, max(int(dims[j]) - 32, 0), int(dims[1 - j])]), label="to")
    else:
        blocks = t.data.reshape(t.data.shape[0], -1, BLOCK_BYTES[gguf.GGMLQuantizationType(t.tensor_type).name])
        at = data.draw(st.lists(st.tuples(st.integers(0, blocks.shape[0] - 1), st.integers(0, blocks.shape[1] - 1)),
                                min_size=1, max_size=3), label="blocks")
        head = data.draw(st.sampled_from([0, 2] if blocks.shape[-1] == 20 else [0]), label="d or m")
        bits = data.draw(st.sampled_from(F16_BITS), label="f16")
        for r, c in at:
            blocks[r, c, head : head + 2] = np.array([bits], np.uint16).view(np.uint8)
    reader.data.flush()
    del reader, t
    return True


@SETTINGS
@given(data=st.data())
def test_gguf_blocks_are_read_exactly_or_refused_in_one_line(gguf_checkpoint, tmp_path_factory, data):
    src, shapes = gguf_checkpoint
    path = tmp_path_factory.mktemp("case") / "q.gguf"
    shutil.copy(src, path)
    changed = _damage_gguf(data, path, sorted(shapes))
    got = _read(path)
    reference: dict[str, np.ndarray | None] = {}
    if got is not None:  # the file passed decodert's header walk: the gguf package may read it
        stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
        for name in NAMES:
            i, w = name.split(".")[1:]
            refs = []
            for _, tensor in PARTS[w]:
                t = stored[f"blk.{i}.{tensor}.weight"]
                n, k = (int(d) for d in reversed(t.shape.tolist()))
                refs.append(gguf_reference(gguf.GGMLQuantizationType(t.tensor_type).name, np.asarray(t.data), n, k))
            reference[name] = None if any(r is None for r in refs) else np.concatenate(refs)
    _check(got, reference, packed=False, damaged=changed)
    path.unlink()


# -- MXFP4 (gpt-oss experts: *_blocks U8 [E, N, G, 16] + *_scales U8 [E, N, G]) ----------------------------------------
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # OCP FP4 E2M1 codes
EXPERTS = {f"model.layers.{i}.mlp.experts.{w}": f"layers.{i}.experts.{c}" for i in range(2)
           for w, c in (("gate_up_proj", "gate_up"), ("down_proj", "down"))}


def mxfp4_reference(blocks: tuple[str, np.ndarray], scales: tuple[str, np.ndarray]) -> np.ndarray | None:
    """Experts [E, N, G * 32] float32: value 2i in the low, 2i + 1 in the high nibble of byte i of a block, times
    2 ** (scale - 127); None when the tensors are not that layout or a value overflows float32."""
    (bd, b), (sd, s) = blocks, scales
    if bd != "U8" or sd != "U8" or b.ndim != 4 or b.shape[-1] != 16 or s.shape != b.shape[:3]:
        return None
    codes = np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:3], 32)  # [E, N, G, 32]
    with np.errstate(over="ignore"):
        w = np.asarray(E2M1, np.float32)[codes] * np.exp2(s.astype(np.float32) - 127)[..., None]
    return w.reshape(*b.shape[:2], -1).astype(np.float32) if np.isfinite(w).all() else None


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A gpt-oss checkpoint whose experts are MXFP4 of random valid blocks (scales around 2 ** -6)."""
    from safetensors.numpy import load_file

    src = tiny_checkpoint("gpt_oss")
    tensors = {k: ("F32", v.astype(np.float32)) for k, v in load_file(str(src / "model.safetensors")).items()}
    rng = np.random.default_rng(45)
    for key in EXPERTS:
        e, k, n = tensors.pop(key)[1].shape  # transformers' parameter [E, in, out]
        tensors[key + "_blocks"] = ("U8", rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8))
        tensors[key + "_scales"] = ("U8", rng.integers(118, 124, (e, n, k // 32), dtype=np.uint8))
    folder = tmp_path_factory.mktemp("mxfp4")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    return folder, tensors


@settings(SETTINGS, max_examples=20)
@given(data=st.data())
def test_mxfp4_experts_are_read_exactly_or_refused_in_one_line(mxfp4_checkpoint, tmp_path_factory, data):
    folder, tensors = mxfp4_checkpoint
    kind = data.draw(st.sampled_from(["none", "dtype", "shape", "values", "missing"]), label="kind")
    damaged = dict(tensors)
    if kind != "none":
        key = data.draw(st.sampled_from(sorted(EXPERTS)), label="experts") + data.draw(
            st.sampled_from(["_blocks", "_scales"]), label="tensor")

        def write(dtype: str, a: np.ndarray, at: list[int]) -> tuple[str, np.ndarray]:
            a.flat[at] = data.draw(st.sampled_from([0, 127, 200, 254, 255]) if key.endswith("_scales")
                                   else st.integers(0, 255), label="byte")
            return dtype, a

        damaged = _damaged(data, tensors, key, kind, write)
    copy = tmp_path_factory.mktemp("case")
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    save_safetensors(copy / "model.safetensors", damaged)
    try:
        ckpt = open_checkpoint(copy)
        got = {name: np.stack([ckpt.expert(name, j) for j in range(8)]) for name in EXPERTS.values()}
        ckpt.close()
    except DecodertError as e:
        _one_line(e)
        assert kind != "none", "an undamaged checkpoint was refused"
        got = None
    for key, name in EXPERTS.items():
        if got is not None:
            pair = (damaged.get(key + "_blocks"), damaged.get(key + "_scales"))
            ref = None if None in pair else mxfp4_reference(*pair)
            assert ref is not None, f"{name}: read although its tensors are not a valid layout"
            np.testing.assert_array_equal(got[name], ref, err_msg=name)
    shutil.rmtree(copy)
