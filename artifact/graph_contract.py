"""The graph I/O contract a manifest promises: every input and output the backends bind, with the dtypes and
shapes its kv / max_seq / vocab / states / LoRA slots imply (checked by artifact/manifest.validate), and the
inputs that have defaults (which a TensorRT engine keeps or folds: ``decodert build`` and the trt backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.plugins.ops.kv_dtypes import KV_DTYPES, KVDtype

Manifest = Any  # artifact/manifest.Manifest (which imports this module, so it is not imported here)
# inputs whose value defaults to an initializer of the same name (a call that does not bind them gets it);
# TensorRT's ONNX parser folds such an input into a constant, so ``decodert build`` parses the graphs without
# the defaults of ENGINE_INPUTS (the engines take those) and folds the rest (export/trt_graphs.py)
DEFAULTED_INPUTS = ("per_position", "image_embeds", "image_positions", "image_ahead", "deepstack_embeds", "rope_offsets")
IMAGE_INPUTS = ("image_embeds", "image_positions", "image_ahead", "deepstack_embeds")  # what a prefill with images binds
ENGINE_INPUTS = (*IMAGE_INPUTS, "rope_offsets")  # defaulted inputs a TensorRT engine keeps (M-RoPE: every graph)


def need(ok: bool, path: Path, what: str) -> None:
    """A manifest check: DecodertError naming the file and what is wrong."""
    if not ok:
        raise DecodertError(f"{path}: {what}")


def runtime_io(m: Manifest) -> dict[str, tuple[str, list | None]]:
    """name -> (dtype, shape or None) of every graph input/output a backend binds."""
    kv, kvd = m.kv, kv_storage(m)
    io: dict[str, tuple[str, list | None]] = {
        "input_ids": ("int64", None), "past_lengths": ("int64", ["batch"]), "seq_lengths": ("int64", ["batch"]),
        "logits": ("fp32", ["batch", m.model.vocab_size]), "next_token": ("int64", ["batch"])}
    for i, d in zip(kv.layers, kv.dims):
        cache = ["batch", kv.num_kv_heads, m.max_seq, kvd.width(d)]  # allocated by the backends
        for name in ("past_key", "past_value", "present_key", "present_value"):
            io[f"{name}.{i}"] = (kvd.storage, cache)
    for st in kv.states:
        io[f"past_{st.io_name}"] = io[f"present_{st.io_name}"] = (st.dtype or m.dtype, list(st.shape))
    if m.lora_layout is not None:
        io.update({t["name"]: (t["dtype"], t["shape"]) for t in m.lora_layout.inputs(m.model.spec(), m.dtype)})
    return io


def kv_storage(m: Manifest) -> KVDtype:
    """The KV cache's element type (plugins/ops/kv_dtypes.py); an artifact without ``kv_dtype`` keeps it in ``dtype``."""
    return KV_DTYPES[m.kv_dtype or m.dtype]


def check_contract(m: Manifest, path: Path, kinds: tuple[str, ...]) -> None:
    """Each graph lists what the backends bind, with the dtypes and cache shapes kv/max_seq/vocab imply."""
    for kind in kinds:
        g = m.graphs[kind]
        listed = g.io()
        need(2 * m.kv.num_layers + 3 <= len(g.inputs), path,  # before runtime_io makes 4 names per layer
              f"kv.num_layers {m.kv.num_layers} does not match graphs.{kind}.inputs")
        bound = runtime_io(m)
        _check_tensors(listed, bound, path, f"graphs.{kind}", "kv/max_seq/model.vocab_size")
        images = m.model.images
        if kind == "prefill" and images is not None:
            bound.update(image_embeds=(m.dtype, ["image_tokens", m.model.hidden_size]),
                         image_positions=("int64", ["image_tokens"]))
            if images.bidirectional:
                bound["image_ahead"] = ("int64", ["image_tokens"])
            if images.deepstack_layers:
                bound["deepstack_embeds"] = (m.dtype, [images.deepstack_layers, "image_tokens", m.model.hidden_size])
        if m.model.mrope is not None:  # M-RoPE: every graph takes the 3-D position offsets
            bound["rope_offsets"] = ("int64", [3, "batch", "seq" if kind != "decode" else 1])
        if kind == "prefill" and g.verifies_rows:
            _check_per_position(m, listed, path)
            bound["per_position"] = ("int64", [1])
        extra = [t.name for t in g.inputs if t.name not in bound]  # an input nobody binds
        need(not extra, path, f"graphs.{kind}: input {extra[:1]} is not one the runtime binds (kv.num_layers?)")


def _check_tensors(listed: dict, want: dict[str, tuple[str, list | None]], path: Path, where: str, source: str) -> None:
    """Each wanted name is listed with its dtype and (unless None) its shape; ``source``: what implies them."""
    for name, (dtype, shape) in want.items():
        t = listed.get(name)
        ok = t is not None and t.dtype == dtype and (shape is None or list(t.shape) == shape)
        need(ok, path, f"{where}: {name!r} is missing or disagrees with {source}")


def _check_per_position(m: Manifest, listed: dict, path: Path) -> None:
    """graphs.prefill's one-row verify input comes with its outputs and a verify graph beside it."""
    need("verify" in m.graphs, path, "graphs.prefill takes per_position but there is no graphs.verify")
    vocab = m.model.vocab_size
    want: dict[str, tuple[str, list | None]] = {
        "per_position": ("int64", [1]), "seq_logits": ("fp32", ["batch", "positions", vocab]),
        "next_tokens": ("int64", ["batch", "positions"])}
    _check_tensors(listed, want, path, "graphs.prefill", "model.vocab_size")


def check_verify(m: Manifest, path: Path) -> None:
    """graphs.verify (speculative decoding; artifacts exported before it have none): the prefill
    contract without seq_lengths, per-position outputs, and its width per call."""
    g = m.graphs.get("verify")
    if g is None:
        return
    need(g.max_tokens is not None and g.max_tokens >= 1, path, "graphs.verify is malformed")
    need(2 * m.kv.num_layers + 2 <= len(g.inputs), path, f"kv.num_layers {m.kv.num_layers} does not match graphs.verify.inputs")
    bound = runtime_io(m)
    bound.pop("seq_lengths"), bound.pop("logits"), bound.pop("next_token")
    bound["seq_logits"] = ("fp32", ["batch", "seq", m.model.vocab_size])
    bound["next_tokens"] = ("int64", ["batch", "seq"])
    if m.model.mrope is not None:
        bound["rope_offsets"] = ("int64", [3, "batch", "seq"])
    listed = g.io()
    _check_tensors(listed, bound, path, "graphs.verify", "kv/max_seq/model.vocab_size")
    extra = [t.name for t in g.inputs if t.name not in bound]
    need(not extra, path, f"graphs.verify: input {extra[:1]} is not one the runtime binds")
