"""An encoder-decoder's engines (Whisper: encoder.engine, decoder.engine, built by ``decodert build`` from a --target
trt export: export/trt_seq2seq.py) on the trt backend, with the verbs runtime/audio/whisper.py uses of its ONNX
Runtime graphs (``OrtGraphs``): ``encode(windows, slots)`` and ``step(start, ids) -> logits``.

    host (pinned staging)                   device (fixed buffers)
    feats   [B, M, 2T] f32    --h2d-->      input_features [n, M, 2T]           (encoder)
                                            encoder_hidden [n, T, C], enc_cross_* [n, H, T, D]   (encoder outputs)
                                            cross_*   [slots, H, T, D]  one buffer per name; window k's rows copied
                                                      d2d into its slot (bound read-only into every decoder step)
    ids     [B*S] int64       --h2d-->      input_ids      [n, S]               (decoder)
    lengths [B]   int64       --h2d-->      past_lengths   [n]
                                            past_key.i == present_key.i [slots, H, S_max, D] (KVCache, in place)
    logits  [B, V] f32        <--d2h--      logits         [n, V]

Rows [start, start + n) of a call are bound at row ``start`` of each buffer. One scratch allocation serves both
engines (they run one after another on one stream). Without a GPU, tests/helpers/trt_emulator.py runs it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from decodert.artifact.manifest import EngineRecord, from_json
from decodert.artifact.seq2seq import graph_record
from decodert.artifact.trt_engines import check_io, engine_io, make_logger
from decodert.errors import DecodertError
from decodert.plugins import cuda_mem as cm
from decodert.plugins.trt.compat import load_trt, read_engine
from decodert.runtime.backends.kv_cache import KVCache

NAMES = ("encoder", "decoder")


class TrtSeq2seq:
    """encoder.engine + decoder.engine over a device KV cache and per-slot cross K/V buffers."""

    def __init__(self, folder: Path, record: dict, spec: Any, max_batch: int) -> None:
        self.trt, self.info = load_trt()
        recs = {n: from_json(EngineRecord, r, f"seq2seq.json engines.{n}") for n, r in (record.get("engines") or {}).items()}
        missing = [n for n in NAMES if n not in recs]
        if missing:
            raise DecodertError(f"{folder} has no {missing[0]} engine; run `decodert build {folder}`")
        blobs = {n: read_engine(folder, SimpleNamespace(engines=recs), n, self.info) for n in NAMES}  # CPU checks first
        if cm.gpu_count() < 1:
            raise DecodertError("no CUDA GPU 0 is visible (nvidia-smi?); use --backend ort on this machine")
        cm.set_device(0)
        self.spec, self.max_batch = spec, max_batch
        self.max_prompt = int(recs["decoder"].max_seq or spec.max_target_positions)  # the profile's longest call
        self.stream = cm.Stream()
        self.logger = make_logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self.graphs = {n: graph_record(folder / record["graphs"][n]) for n in NAMES}
        self.engines = {}
        for n in NAMES:
            engine = self.runtime.deserialize_cuda_engine(blobs[n])
            if engine is None:
                raise DecodertError(f"{folder / recs[n].file}: TensorRT could not deserialize the engine "
                                    "(set DECODERT_TRT_VERBOSE=1)")
            check_io(engine_io(self.trt, engine, self.graphs[n]), self.graphs[n], str(folder / recs[n].file))
            self.engines[n] = engine
        self.scratch = cm.DeviceBuffer(max(int(e.device_memory_size_v2) for e in self.engines.values()))
        self.ctx = {n: self._context(e) for n, e in self.engines.items()}
        s = spec
        heads, t, d = s.decoder_heads, s.max_source_positions, s.head_dim
        self.cache = KVCache(max_batch, s.max_target_positions, s.decoder_layers, heads, d, np.float32, device="cuda")
        self.cross_names = [f"cross_{k}.{i}" for i in range(s.decoder_layers) for k in ("key", "value")]
        self.cross_bytes = heads * t * d * 4  # one slot of one cross buffer
        self.cross = {name: cm.DeviceBuffer(max_batch * self.cross_bytes) for name in self.cross_names}
        feats = s.num_mel_bins * s.window_frames
        self.h = {"feats": cm.PinnedArray((max_batch * feats,), np.float32),
                  "ids": cm.PinnedArray((max_batch * self.max_prompt,), np.int64),
                  "lengths": cm.PinnedArray((max_batch,), np.int64),
                  "logits": cm.PinnedArray((max_batch, s.vocab_size), np.float32)}
        self.d = {name: cm.DeviceBuffer(self.h[name].nbytes) for name in self.h}
        self.d["hidden"] = cm.DeviceBuffer(max_batch * t * s.d_model * 4)
        self.enc_cross = {name: cm.DeviceBuffer(max_batch * self.cross_bytes) for name in self.cross_names}

    def _context(self, engine: Any) -> Any:
        strategy = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
        if self.info.has_runtime_cache:  # TensorRT-RTX: contexts come from a runtime config
            cfg = engine.create_runtime_config()
            cfg.set_execution_context_allocation_strategy(strategy)
            ctx = engine.create_execution_context(cfg)
        else:
            ctx = engine.create_execution_context(strategy)
        if ctx is None:
            raise DecodertError("TensorRT could not create an execution context for the Whisper engines")
        ctx.set_device_memory(self.scratch.ptr, self.scratch.nbytes)
        return ctx

    def _run(self, name: str, addresses: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> None:
        ctx = self.ctx[name]
        for tensor, ptr in addresses.items():
            if not ctx.set_tensor_address(tensor, ptr):
                raise DecodertError(f"TensorRT rejected the address of tensor '{tensor}' of the {name} engine")
        for tensor, shape in shapes.items():
            if not ctx.set_input_shape(tensor, shape):
                raise DecodertError(f"input '{tensor}' shape {shape} is outside the {name} engine's profile "
                                    "(rebuild with a larger --max-batch / --max-seq)")
        if not ctx.execute_async_v3(self.stream.handle):
            raise DecodertError(f"TensorRT failed to run the {name} engine (set DECODERT_TRT_VERBOSE=1)")

    def encode(self, windows: np.ndarray, slots: Sequence[int]) -> None:
        """encoder.engine over ``windows`` [n, M, 2T]; window k's cross K/V copied into row ``slots[k]``."""
        x = np.ascontiguousarray(windows, np.float32)
        n = x.shape[0]
        if not 1 <= n <= self.max_batch:
            raise DecodertError(f"{n} windows in one encoder call; the engines take 1..{self.max_batch}")
        self.h["feats"].array[: x.size] = x.reshape(-1)
        cm.copy_async(self.d["feats"].ptr, self.h["feats"].ptr, x.nbytes, self.stream, "h2d")
        addresses = {"input_features": self.d["feats"].ptr, "encoder_hidden": self.d["hidden"].ptr,
                     **{name: buf.ptr for name, buf in self.enc_cross.items()}}
        self._run("encoder", addresses, {"input_features": x.shape})
        for k, slot in enumerate(slots):
            for name in self.cross_names:
                cm.copy_async(self.cross[name].ptr + slot * self.cross_bytes, self.enc_cross[name].ptr + k * self.cross_bytes,
                              self.cross_bytes, self.stream, "d2d")
        self.stream.sync()

    def step(self, start: int, ids: np.ndarray) -> np.ndarray:
        """decoder.engine over rows [start, start + n) for ``ids`` [n, S] -> logits [n, V] (K/V written in place)."""
        ids = np.ascontiguousarray(ids, np.int64)
        n, width = ids.shape
        if width > self.max_prompt:
            raise DecodertError(f"a {width}-token decoder call; the decoder engine takes up to {self.max_prompt} "
                                "(rebuild with a larger --max-seq)")
        self.h["ids"].array[: ids.size] = ids.reshape(-1)
        self.h["lengths"].array[:n] = self.cache.lengths[start : start + n]
        cm.copy_async(self.d["ids"].ptr, self.h["ids"].ptr, ids.nbytes, self.stream, "h2d")
        cm.copy_async(self.d["lengths"].ptr, self.h["lengths"].ptr, n * 8, self.stream, "h2d")
        addresses = {"input_ids": self.d["ids"].ptr, "past_lengths": self.d["lengths"].ptr, "logits": self.d["logits"].ptr}
        s = self.spec
        shapes: dict[str, tuple[int, ...]] = {"input_ids": (n, width), "past_lengths": (n,)}
        for i in range(s.decoder_layers):
            for j, kind in enumerate(("key", "value")):
                addresses[f"past_{kind}.{i}"] = addresses[f"present_{kind}.{i}"] = self.cache.pointer(2 * i + j, start)
                shapes[f"past_{kind}.{i}"] = (n, s.decoder_heads, s.max_target_positions, s.head_dim)
        for name in self.cross_names:
            addresses[name] = self.cross[name].ptr + start * self.cross_bytes
            shapes[name] = (n, s.decoder_heads, s.max_source_positions, s.head_dim)
        self._run("decoder", addresses, shapes)
        cm.copy_async(self.h["logits"].ptr, self.d["logits"].ptr, n * s.vocab_size * 4, self.stream, "d2h")
        self.stream.sync()
        return self.h["logits"].array[:n].copy()

    def close(self) -> None:
        """Free GPU memory."""
        self.ctx = {}
        self.cache.free()
        buffers: list[cm.PinnedArray | cm.DeviceBuffer] = [*self.h.values(), *self.d.values(), *self.cross.values(),
                                                            *self.enc_cross.values(), self.scratch]
        for buf in buffers:
            buf.free()
        self.stream.destroy()
