"""ONNX Runtime verify passes (speculative decoding) and the binding of a cache's buffers, for
runtime/backends/ort/backend.py: a session's IOBindings per slot range and width, over fixed buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort

from decodert.runtime.backends.kv_cache import KVCache


class VerifyState:
    """A session running verify passes and its IOBindings per (cache, first slot, rows, width);
    every binding views one set of per-call buffers (calls run one at a time, copied out at once).
    kind "prefill": the prefill graph with per_position=1 (one row, its last-token outputs unused)."""

    def __init__(self, session: ort.InferenceSession, kind: str, batch: int, width: int, vocab: int,
                 windows: dict[str, int] | None = None, lora: dict[str, np.ndarray] | None = None,
                 hidden: tuple[int, Any] | None = None) -> None:
        """``windows``: the verify graph's conv windows to bind, state name ("conv.3") -> K-1 (its outputs
        ``window_conv.3`` [n, C, K-1+w]: the states after each position, docs/SPECULATIVE.md). ``hidden``:
        (width, dtype) of the ``seq_hidden`` output to bind (a draft head reads it; None: not bound)."""
        self.session, self.kind, self.vocab, self.lora = session, kind, vocab, lora
        self.windows = dict(windows or {})
        self.window_bufs: dict[tuple[int, int, int, int], dict[str, np.ndarray]] = {}
        self.ids = np.zeros(batch * width, np.int64)  # [n*W] input_ids
        self.past = np.zeros(batch, np.int64)  # [n] past_lengths
        self.logits = np.empty(batch * width * vocab, np.float32)  # [n*W*V] seq_logits
        self.next = np.empty(batch * width, np.int64)  # [n*W] next_tokens
        self.hidden_width = hidden[0] if hidden else 0
        self.hidden = np.empty(batch * width * hidden[0], hidden[1]) if hidden else None  # [n*W*hidden] seq_hidden
        if kind == "prefill":
            self.seq = np.zeros(batch, np.int64)  # [n] seq_lengths (= w: one row, unpadded)
            self.on = np.ones(1, np.int64)  # per_position
            self.last = (np.empty((batch, vocab), np.float32), np.empty(batch, np.int64))  # logits, next_token
        self.bindings: dict[tuple[int, int, int, int], Any] = {}
        takes = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}  # defaulted too
        self.offsets = np.zeros(3 * batch * width, np.int64) if "rope_offsets" in takes else None  # M-RoPE

    def offsets_view(self, n: int, w: int) -> np.ndarray | None:
        """rope_offsets [3, n, w] of the next call (None: the graph takes none)."""
        return None if self.offsets is None else self.offsets[: 3 * n * w].reshape(3, n, w)

    def hidden_view(self, n: int, w: int) -> np.ndarray:
        """seq_hidden [n, w, hidden] of the last call (with ``hidden``)."""
        assert self.hidden is not None
        return self.hidden[: n * w * self.hidden_width].reshape(n, w, -1)

    def binding(self, cache: KVCache, start: int, n: int, w: int) -> tuple:
        """(io, ids [n, w], past [n], logits [n, w, V], next_tokens [n, w], windows {state: [n, C, K-1+w]})
        for slots [start, start+n)."""
        views = (self.ids[: n * w].reshape(n, w), self.past[:n], self.logits[: n * w * self.vocab].reshape(n, w, -1),
                 self.next[: n * w].reshape(n, w))
        key = (id(cache), start, n, w)
        io = self.bindings.get(key)
        if io is None:
            io = self.bindings[key] = self.session.io_binding()
            inputs = [("input_ids", views[0]), ("past_lengths", views[1])]
            outputs = [("seq_logits", views[2]), ("next_tokens", views[3])]
            if self.kind == "prefill":
                inputs += [("seq_lengths", self.seq[:n]), ("per_position", self.on)]
                outputs += [("logits", self.last[0][:n]), ("next_token", self.last[1][:n])]
            if self.offsets is not None:
                inputs.append(("rope_offsets", self.offsets_view(n, w)))
            if self.hidden is not None:
                outputs.append(("seq_hidden", self.hidden_view(n, w)))
            wins = self.window_bufs[key] = {}
            for name, keep in self.windows.items():
                j = cache.state_names.index(name)
                wins[name] = np.empty((n, cache.state_shapes[j][0], keep + w), cache.state_dtypes[j])
                outputs.append((f"window_{name}", wins[name]))
            for name, arr in inputs:
                io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            for name, arr in outputs:
                io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            bind_cache(io, cache, start, n, self.lora)
        if self.kind == "prefill":
            self.seq[:n] = w
        return (io, *views, self.window_bufs[key])


def bind_cache(io: Any, cache: KVCache, start: int, n: int, lora: dict[str, np.ndarray] | None = None) -> None:
    """Bind slots [start, start+n) of every K/V buffer and every state (one contiguous view each)
    as past and present; with LoRA slots, the rows' adapter indices (``cache.adapters``) and the stacked
    adapter weights."""
    if lora is not None:
        index = cache.adapters[start : start + n]
        io.bind_input("lora_index", "cpu", 0, index.dtype, index.shape, index.ctypes.data)
        for name, arr in lora.items():
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
    for i in range(len(cache.buffers)):
        shape = (n, *cache.slot_shapes[i])
        ptr = cache.pointer(i, start)
        pair, kv = divmod(i, 2)
        suffix = f"{('key', 'value')[kv]}.{cache.kv_layers[pair]}"
        io.bind_input(f"past_{suffix}", cache.device, 0, cache.dtype, shape, ptr)
        io.bind_output(f"present_{suffix}", cache.device, 0, cache.dtype, shape, ptr)
    for j, name in enumerate(cache.state_names):
        ptr, st_shape = cache.state_pointer(j, start), (n, *cache.state_shapes[j])
        io.bind_input(f"past_{name}", cache.device, 0, cache.state_dtypes[j], st_shape, ptr)
        io.bind_output(f"present_{name}", cache.device, 0, cache.state_dtypes[j], st_shape, ptr)

