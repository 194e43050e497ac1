"""Verify passes (speculative decoding) of the trt backend: the verify engine over the bound KV cache.

    host (pinned)                          device
    ids     [B*W] int64     --h2d-->       input_ids     [n, w]      right-padded per row
    lens    [B]   int64     --h2d-->       past_lengths  [n]
    (M-RoPE)                --h2d-->       rope_offsets  [3, n, w]   runtime/backends/trt/mrope.py
    next    [B*W] int64     <--d2h--       next_tokens   [n, w]      (argmax on the GPU)
    logits  [B*W*V] f32     <--d2h--       seq_logits    [n, w, V]   (only when asked for)
                                           past_* == present_*       the backend's cache, at the run's first slot

Rows run per contiguous slot run in one call (the trt target's verify graph takes several rows over
caches), KV bound at the run's first slot as prefill does; a row whose padded width would pass the
end of its context runs alone (runtime/backends/trt/engine.py ``fitting_runs``). Rejected tokens are dropped
by the caller rewinding the cache (``KVCache.rewind``), as on every backend.

The engine is deserialized at the first ``prepare_verify`` or ``verify``, not at load: it holds its
own copy of the weights on the GPU unless the engines are weight-stripped, and plain decoding never
needs it. Its context takes the backend's scratch memory when that is large enough, its own else.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.plugins import cuda_mem as cm
from decodert.plugins.trt.compat import read_engine
from decodert.runtime.backends.backend import VerifyOutput, window_outputs
from decodert.runtime.backends.kv_cache import KVCache
from decodert.runtime.backends.trt.engine import Engine, TrtHost, bind, fitting_runs


def verify_width(backend: TrtHost) -> int:
    """Tokens one verify call takes per row: the verify graph's max_tokens within the engine's
    profile (0: the artifact has no verify graph, or its engines were built before it had one)."""
    graph = backend.manifest.graphs.get("verify")
    rec = (backend.manifest.engines or {}).get("verify")
    if graph is None or rec is None:
        return 0
    seq_max = (rec.profile.get("input_ids") or {}).get("max") or [0, rec.max_seq or 0]
    return min(int(graph.max_tokens or 0), int(seq_max[1]))


class TrtVerifier:
    """The verify engine, its context and its staging buffers for one TrtBackend."""

    def __init__(self, backend: TrtHost) -> None:
        self.backend = backend
        self.width = verify_width(backend)
        self.ctx: Any = None
        self.engine: Engine | None = None
        self.own_scratch: cm.DeviceBuffer | None = None
        self.h: dict[str, cm.PinnedArray] = {}
        self.windows: dict[str, int] = {}
        self.np_dtype: Any = None
        self.d: dict[str, cm.DeviceBuffer] = {}

    def open(self) -> None:
        """Deserialize the verify engine and allocate its buffers (idempotent)."""
        if self.ctx is not None:
            return
        b = self.backend
        if not self.width:
            what = "graph" if "verify" not in b.manifest.graphs else "engine"
            raise DecodertError(f"{b.dir} has no verify {what} (made before speculative decoding); "
                                + ("re-export it" if what == "graph" else f"run `decodert build {b.dir}` again"))
        self.engine = Engine(b, "verify", read_engine(b.dir, b.manifest, "verify", b.info))
        scratch = b.scratch
        if self.engine.scratch_bytes > scratch.nbytes:
            scratch = self.own_scratch = cm.DeviceBuffer(self.engine.scratch_bytes)
        n, v = b.max_batch * self.width, b.vocab_size
        self.h = {"ids": cm.PinnedArray((n,), np.int64), "lens": cm.PinnedArray((b.max_batch,), np.int64),
                  "next": cm.PinnedArray((n,), np.int64), "logits": cm.PinnedArray((n * v,), np.float32)}
        self.windows = window_outputs(b.manifest)  # conv windows (rows of a hybrid run alone): [C, K-1+w] each
        self.np_dtype = {"fp32": np.float32, "fp16": np.float16}.get(b.manifest.dtype)
        channels = {st.io_name: int(st.shape[1]) for st in b.manifest.kv.states}
        for name, keep in self.windows.items():
            self.h[f"window_{name}"] = cm.PinnedArray((channels[name] * (keep + self.width) * b.itemsize,), np.uint8)
        self.d = {k: cm.DeviceBuffer(a.nbytes) for k, a in self.h.items()}
        if any(t.name == "seq_hidden" for t in b.manifest.graphs["verify"].outputs):  # --hidden-states: bound, unread
            self.d["seq_hidden"] = cm.DeviceBuffer(n * b.hidden_bytes)
        self.ctx = self.engine.context(scratch)

    def verify(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> VerifyOutput:
        b = self.backend
        self.open()  # first: without a verify engine, say which re-export or rebuild gives one
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in ids]
        lens = [len(r) for r in rows]
        width = max(lens, default=0)
        if not rows or min(lens) < 1 or width > self.width:
            raise DecodertError(f"verify takes 1..{self.width} tokens per row, got {lens}")
        b.check_rows(cache, slots, lens)
        n = len(slots)
        out = VerifyOutput(np.zeros((n, width), np.int64),
                           np.zeros((n, width, b.vocab_size), np.float32) if want_logits else None)
        if self.windows and self.np_dtype is not None:  # bf16 windows stay on the GPU: speculation replays instead
            out.windows = [{} for _ in slots]
        for run in fitting_runs(slots, cache.lengths, lens, b.max_seq):
            for part in [[pair] for pair in run] if cache.has_state else [run]:  # hybrid rows: unpadded, alone
                with cache.writing([s for _, s in part], b.stream.sync):  # states and record together (kv_cache.py)
                    self._run(cache, part, rows, out)
                    cache.commit([s for _, s in part], [rows[j] for j, _ in part])
        return out

    def _run(self, cache: KVCache, run: list[tuple[int, int]], rows: list[np.ndarray], out: VerifyOutput) -> None:
        b, k, row0 = self.backend, len(run), run[0][1]
        w = max(len(rows[j]) for j, _ in run)
        ids = self.h["ids"].array[: k * w].reshape(k, w)
        ids[:] = 0
        for r, (j, _) in enumerate(run):
            ids[r, : len(rows[j])] = rows[j]
        self.h["lens"].array[:k] = cache.lengths[row0 : row0 + k]
        for key, nbytes in (("ids", k * w * 8), ("lens", k * 8)):
            cm.copy_async(self.d[key].ptr, self.h[key].ptr, nbytes, b.stream, "h2d")
        if b.mrope is not None:  # M-RoPE: each row's offsets after what its slot holds (runtime/backends/trt/mrope.py)
            b.mrope.write("verify", cache, [(s, rows[j]) for j, s in run], w)
        shapes = {name: shape for name, shape in b.io_shapes(k, w).items() if name != "seq_lengths"}
        addresses = {"input_ids": self.d["ids"].ptr, "past_lengths": self.d["lens"].ptr,
                     "next_tokens": self.d["next"].ptr, "seq_logits": self.d["logits"].ptr, **b.kv_addresses(cache, row0),
                     **{f"window_{name}": self.d[f"window_{name}"].ptr for name in self.windows},
                     **({"seq_hidden": self.d["seq_hidden"].ptr} if "seq_hidden" in self.d else {}),
                     **(b.mrope.address("verify") if b.mrope is not None else {})}
        bind(self.ctx, addresses, shapes)
        b.execute(self.ctx, "verify")
        b.stats["verify_runs"] += 1
        cm.copy_async(self.h["next"].ptr, self.d["next"].ptr, k * w * 8, b.stream, "d2h")
        if out.logits is not None:
            cm.copy_async(self.h["logits"].ptr, self.d["logits"].ptr, k * w * b.vocab_size * 4, b.stream, "d2h")
        sizes = {name: (keep + w) * self.h[f"window_{name}"].nbytes // (keep + self.width) for name, keep in self.windows.items()}
        for name, nbytes in sizes.items():
            cm.copy_async(self.h[f"window_{name}"].ptr, self.d[f"window_{name}"].ptr, nbytes, b.stream, "d2h")
        b.stream.sync()
        if out.windows is not None and k == 1:
            out.windows[run[0][0]] = {name: self.h[f"window_{name}"].array[:nbytes].view(self.np_dtype)
                                      .reshape(-1, self.windows[name] + w).copy() for name, nbytes in sizes.items()}
        js = [j for j, _ in run]
        out.next_tokens[js, :w] = self.h["next"].array[: k * w].reshape(k, w)
        if out.logits is not None:
            out.logits[js, :w] = self.h["logits"].array[: k * w * b.vocab_size].reshape(k, w, -1)

    def close(self) -> None:
        self.ctx = None
        for pinned in self.h.values():
            pinned.free()
        for buf in [*self.d.values(), *([self.own_scratch] if self.own_scratch else [])]:
            buf.free()
        self.h, self.d, self.own_scratch = {}, {}, None
