"""Tiny hand-built trt-target artifacts that follow the graph contract (docs/ARCHITECTURE.md).

Used by tests/export/test_trt_build.py to exercise `decodert build` without the real exporter. One
decoder layer, the way the trt lowering spells it (standard ops TensorRT maps to native layers):

    input_ids [B,S] -> Gather(embed) -> x [B,S,E]
    x -> RMSNormalization -> MatMul(w_qkv) -> Split -> q [B,Hq,S,D], k/v [B,Hkv,S,D]
    positions [B,S] = past_lengths[:,None] + arange(S)
    q, k -> RotaryEmbedding-23(position_ids=positions)
    present_key.i   = TensorScatter-24(past_key.i,   k, write_indices=past_lengths)  (in place)
    present_value.i = TensorScatter-24(past_value.i, v, write_indices=past_lengths)
    mask [B,1,S,Smax] = arange(Smax)[None,None,:] <= positions[:,:,None]
    Attention-23(q, present_key.i, present_value.i, mask) -> [B,Hq,S,D] -> MatMul(w_o) + x
    last valid row (seq_lengths - 1) -> RMSNormalization -> MatMul(lm_head) -> logits [B,V] f32
    next_token [B] = ArgMax(logits)

Weights live in one shared external-data file ``weights.bin`` like a real artifact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from decodert.artifact.artifact_files import file_record
from decodert.artifact.records import to_json

OPSET = 24


@dataclass(frozen=True)
class TinySpec:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    layers: int = 1
    max_seq: int = 64
    max_batch: int = 4


ONNX_DTYPE = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
NP_DTYPE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
I64 = TensorProto.INT64


class _Weights:
    """Appends raw tensors to one weights.bin (once per name) and returns external-data initializers."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype, self.offset = path, dtype, 0
        self.index: dict[str, tuple[int, int]] = {}  # name -> (offset, length)
        path.write_bytes(b"")
        self.rng = np.random.default_rng(0)

    def add(self, name: str, shape: tuple[int, ...], data: np.ndarray | None = None) -> TensorProto:
        if name not in self.index:
            if data is None:
                data = self.rng.standard_normal(shape).astype(np.float32) * 0.1
            raw = np.ascontiguousarray(data.astype(NP_DTYPE[self.dtype])).tobytes()
            with self.path.open("ab") as f:
                f.write(raw)
            self.index[name] = (self.offset, len(raw))
            self.offset += len(raw)
        offset, length = self.index[name]
        init = TensorProto(name=name, data_type=ONNX_DTYPE[self.dtype], dims=list(shape))
        init.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            init.external_data.add(key=k, value=v)
        return init


def _rope_tables(spec: TinySpec) -> tuple[np.ndarray, np.ndarray]:
    # cos/sin [max_seq, D/2]
    inv = 1.0 / (10000.0 ** (np.arange(0, spec.head_dim, 2) / spec.head_dim))
    ang = np.arange(spec.max_seq)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=helper.make_tensor(name, I64, [len(values)], values))


def _prologue(spec: TinySpec) -> list[onnx.NodeProto]:
    """positions [B,S] and the causal mask [B,1,S,Smax] from past_lengths."""
    return [
        _const("c0", [0]), _const("ax1", [1]), _const("ax2", [2]),
        helper.make_node("Constant", [], ["zero"], name="zero", value=helper.make_tensor("zero", I64, [], [0])),
        helper.make_node("Constant", [], ["one"], name="one", value=helper.make_tensor("one", I64, [], [1])),
        helper.make_node("Shape", ["input_ids"], ["seq"], name="/pos/seq", start=1, end=2),
        helper.make_node("Squeeze", ["seq", "c0"], ["seq_s"], name="/pos/seq_s"),
        helper.make_node("Range", ["zero", "seq_s", "one"], ["ar"], name="/pos/range"),  # [S]
        helper.make_node("Unsqueeze", ["past_lengths", "ax1"], ["pl2"], name="/pos/pl2"),  # [B,1]
        helper.make_node("Add", ["pl2", "ar"], ["positions"], name="/pos/add"),  # [B,S]
        helper.make_node("Unsqueeze", ["positions", "ax2"], ["qpos"], name="/mask/qpos"),  # [B,S,1]
        helper.make_node("Constant", [], ["kpos"], name="/mask/kpos",
                         value=helper.make_tensor("kpos", I64, [spec.max_seq], list(range(spec.max_seq)))),
        helper.make_node("LessOrEqual", ["kpos", "qpos"], ["mask3"], name="/mask/le"),  # [B,S,Smax]
        helper.make_node("Unsqueeze", ["mask3", "ax1"], ["mask"], name="/mask/unsq"),  # [B,1,S,Smax]
    ]


def _heads(src: str, dst: str, n: int, spec: TinySpec, p: str) -> list[onnx.NodeProto]:
    """[B,S,n*D] -> [B,n,S,D]"""
    shape = f"{p}/shape_{dst}"
    return [
        _const(shape, [0, 0, n, spec.head_dim]),
        helper.make_node("Reshape", [src, shape], [f"{dst}_bsnd"], name=f"{p}/reshape_{dst}"),
        helper.make_node("Transpose", [f"{dst}_bsnd"], [dst], name=f"{p}/transpose_{dst}", perm=[0, 2, 1, 3]),
    ]


def _layer(i: int, spec: TinySpec, w: _Weights, inits: list, x: str) -> tuple[list[onnx.NodeProto], str]:
    p, s = f"/model/layers.{i}", spec
    q_w, kv_w = s.heads * s.head_dim, s.kv_heads * s.head_dim
    inits += [w.add(f"layers.{i}.norm", (s.hidden,), np.ones(s.hidden)),
              w.add(f"layers.{i}.qkv", (s.hidden, q_w + 2 * kv_w)), w.add(f"layers.{i}.o", (q_w, s.hidden))]
    nodes = [
        helper.make_node("RMSNormalization", [x, f"layers.{i}.norm"], [f"{p}/h"], name=f"{p}/norm", epsilon=1e-5),
        helper.make_node("MatMul", [f"{p}/h", f"layers.{i}.qkv"], [f"{p}/qkv"], name=f"{p}/qkv"),
        _const(f"{p}/split", [q_w, kv_w, kv_w]),
        helper.make_node("Split", [f"{p}/qkv", f"{p}/split"], [f"{p}/q3", f"{p}/k3", f"{p}/v3"], name=f"{p}/split", axis=2),
        *_heads(f"{p}/q3", f"{p}/q0", s.heads, s, p), *_heads(f"{p}/k3", f"{p}/k0", s.kv_heads, s, p),
        *_heads(f"{p}/v3", f"{p}/v", s.kv_heads, s, p),
        helper.make_node("RotaryEmbedding", [f"{p}/q0", "rope_cos", "rope_sin", "positions"], [f"{p}/q"], name=f"{p}/rope_q"),
        helper.make_node("RotaryEmbedding", [f"{p}/k0", "rope_cos", "rope_sin", "positions"], [f"{p}/k"], name=f"{p}/rope_k"),
        helper.make_node("TensorScatter", [f"past_key.{i}", f"{p}/k", "past_lengths"], [f"present_key.{i}"], name=f"{p}/kv_write_k", axis=2),
        helper.make_node("TensorScatter", [f"past_value.{i}", f"{p}/v", "past_lengths"], [f"present_value.{i}"], name=f"{p}/kv_write_v", axis=2),
        helper.make_node("Attention", [f"{p}/q", f"present_key.{i}", f"present_value.{i}", "mask"], [f"{p}/attn"],
                         name=f"{p}/attn", q_num_heads=s.heads, kv_num_heads=s.kv_heads),
        helper.make_node("Transpose", [f"{p}/attn"], [f"{p}/attn_t"], name=f"{p}/attn_t", perm=[0, 2, 1, 3]),
        _const(f"{p}/flat", [0, 0, q_w]),
        helper.make_node("Reshape", [f"{p}/attn_t", f"{p}/flat"], [f"{p}/attn_f"], name=f"{p}/attn_f"),
        helper.make_node("MatMul", [f"{p}/attn_f", f"layers.{i}.o"], [f"{p}/o"], name=f"{p}/o"),
        helper.make_node("Add", [x, f"{p}/o"], [f"{p}/out"], name=f"{p}/residual"),
    ]
    return nodes, f"{p}/out"


def _head(spec: TinySpec, w: _Weights, inits: list, x: str) -> list[onnx.NodeProto]:
    """Last valid row of each sequence -> logits [B,V] float32 and next_token [B] int64."""
    inits += [w.add("final_norm", (spec.hidden,), np.ones(spec.hidden)), w.add("lm_head", (spec.hidden, spec.vocab))]
    return [
        helper.make_node("Sub", ["seq_lengths", "one"], ["last"], name="/head/last"),
        helper.make_node("Unsqueeze", ["last", "ax1"], ["last2"], name="/head/last2"),  # [B,1]
        helper.make_node("GatherND", [x, "last2"], ["x_last"], name="/head/gather", batch_dims=1),  # [B,E]
        helper.make_node("RMSNormalization", ["x_last", "final_norm"], ["h_last"], name="/head/norm", epsilon=1e-5),
        helper.make_node("MatMul", ["h_last", "lm_head"], ["logits_lp"], name="/head/lm_head"),
        helper.make_node("Cast", ["logits_lp"], ["logits"], name="/head/cast", to=TensorProto.FLOAT),
        helper.make_node("ArgMax", ["logits"], ["next_token"], name="/head/argmax", axis=-1, keepdims=0),
    ]


def io_contract(spec: TinySpec, dtype: str, decode: bool) -> tuple[list[dict], list[dict]]:
    """The manifest's inputs/outputs lists for one graph."""
    seq: int | str = 1 if decode else "seq"
    kv: list[int | str] = ["batch", spec.kv_heads, spec.max_seq, spec.head_dim]
    ins: list[dict[str, Any]] = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", seq]},
           {"name": "past_lengths", "dtype": "int64", "shape": ["batch"]},
           {"name": "seq_lengths", "dtype": "int64", "shape": ["batch"]}]
    outs: list[dict[str, Any]] = [{"name": "logits", "dtype": "fp32", "shape": ["batch", spec.vocab]},
            {"name": "next_token", "dtype": "int64", "shape": ["batch"]}]
    for i in range(spec.layers):
        ins += [{"name": f"past_{t}.{i}", "dtype": dtype, "shape": kv} for t in ("key", "value")]
        outs += [{"name": f"present_{t}.{i}", "dtype": dtype, "shape": kv} for t in ("key", "value")]
    return ins, outs


def _value_info(d: dict, dtype: str) -> onnx.ValueInfoProto:
    elem = {"int64": I64, "fp32": TensorProto.FLOAT, dtype: ONNX_DTYPE[dtype]}[d["dtype"]]
    return helper.make_tensor_value_info(d["name"], elem, d["shape"])


def make_graph(spec: TinySpec, dtype: str, decode: bool, weights: _Weights) -> onnx.ModelProto:
    cos, sin = _rope_tables(spec)
    inits = [weights.add("embed", (spec.vocab, spec.hidden)),
             weights.add("rope_cos", cos.shape, cos), weights.add("rope_sin", sin.shape, sin)]
    nodes = [*_prologue(spec), helper.make_node("Gather", ["embed", "input_ids"], ["x0"], name="/model/embed")]
    x = "x0"
    for i in range(spec.layers):
        layer_nodes, x = _layer(i, spec, weights, inits, x)
        nodes += layer_nodes
    nodes += _head(spec, weights, inits, x)
    ins, outs = io_contract(spec, dtype, decode)
    graph = helper.make_graph(nodes, "decode" if decode else "prefill", [_value_info(d, dtype) for d in ins],
                              [_value_info(d, dtype) for d in outs], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=11)


def write_artifact(out: Path, dtype: str = "fp16", spec: TinySpec = TinySpec()) -> Path:
    """Write prefill.onnx, decode.onnx, weights.bin and manifest.json into ``out``; return ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    weights = _Weights(out / "weights.bin", dtype)
    graphs = {}
    for name in ("prefill", "decode"):
        model = make_graph(spec, dtype, name == "decode", weights)
        onnx.save(model, str(out / f"{name}.onnx"))
        ins, outs = io_contract(spec, dtype, name == "decode")
        graphs[name] = {"file": f"{name}.onnx", "inputs": ins, "outputs": outs}
    manifest = _manifest(spec, dtype, graphs, weights.offset)
    manifest["files"] = {p.name: to_json(file_record(p)) for p in sorted(out.iterdir()) if p.suffix in (".onnx", ".bin")}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def _manifest(spec: TinySpec, dtype: str, graphs: dict, nbytes: int) -> dict:
    return {
        "format": "decodert-artifact", "format_version": 1, "target": "trt", "dtype": dtype,
        "model": {"family": "tiny", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
                  "num_layers": spec.layers, "num_heads": spec.heads, "num_kv_heads": spec.kv_heads,
                  "head_dim": spec.head_dim},
        "max_seq": spec.max_seq, "max_batch": spec.max_batch,
        "kv": {"num_layers": spec.layers, "num_kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
               "dtype": dtype, "shape": ["batch", spec.kv_heads, spec.max_seq, spec.head_dim], "inplace": True},
        "graphs": graphs, "weights": {"file": "weights.bin", "bytes": nbytes},
        "tokenizer": {"file": "tokenizer.json", "bos_token_id": None, "eos_token_ids": [0], "pad_token_id": 0,
                      "add_bos_token": False, "chat_template": None},
    }
