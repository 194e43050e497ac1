"""TensorRT backend (runtime/backends/backend.py): prefill/decode engines over an in-place KV cache on the GPU.

    host (pinned staging)                 device (fixed buffers; addresses set once per context)
    pre_ids  [B*Sp] int64   --h2d-->      input_ids     [n, S]      (prefill)
    dec_ids  [B]    int64   --h2d-->      input_ids     [n, 1]      (decode)
    *_len    [B]    int64   --h2d-->      past_lengths  [n]
    pre_seq  [B]    int64   --h2d-->      seq_lengths   [n]         (decode: ones, written once)
    offsets  [3*B*S] int64  --h2d-->      rope_offsets  [3, n, S]   (M-RoPE models: runtime/backends/trt/mrope.py)
                                          past_key.i == present_key.i  [slots, Hkv, Smax, D] one buffer
    next     [B]    int64   <--d2h--      next_token    [n]         (argmax on the GPU)
    logits   [B, V] f32     <--d2h--      logits        [n, V]      (only when asked for)

Decode over slots 0..n-1 (the scheduler keeps active rows compact) runs in one context per batch
size n, bound once; its second call captures [h2d ids, h2d lengths, execute_async_v3, d2h
next_token] into a CUDA graph that later steps replay (the first call runs plainly: TensorRT-RTX
JIT-compiles its kernels there). Any capture failure falls back to plain execute_async_v3. Those
contexts and graphs are kept per recent cache (runtime/backends/trt/baked.py).
Rows that are not a prefix (prefill of a new slot, or odd decode calls) run per contiguous slot
run with the KV tensors bound at that run's first row; a row whose right-padded chunk would pass the
end of its context runs alone (runtime/backends/trt/engine.py). All contexts share one scratch buffer (they
run one after another on one stream). Verify passes (speculative decoding): runtime/backends/trt/verify.py;
images and audio: the prefill engine's image inputs runtime/backends/trt/images.py, the vision and audio
engines runtime/backends/trt/vision.py.
Without a GPU, tests/helpers/trt_emulator.py runs all of this on the CPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.manifest import Manifest
from decodert.artifact.heads import hidden_width
from decodert.artifact.artifact_files import write_atomic
from decodert.artifact.trt_engines import make_logger
from decodert.plugins.trt.compat import load_trt, read_engine
from decodert.plugins import cuda_mem as cm
from decodert.runtime.backends import kv_blocks
from decodert.runtime.backends.backend import StepOutput, VerifyOutput
from decodert.runtime.backends.kv_cache import KVCache
from decodert.runtime.backends.trt.baked import BakedCaches, capture
from decodert.runtime.backends.trt.engine import Engine, bind, contiguous_runs, fitting_runs
from decodert.runtime.backends.trt.images import open_audio, open_images
from decodert.runtime.backends.trt.mrope import RopeOffsets, takes_offsets
from decodert.runtime.backends.trt.verify import TrtVerifier, verify_width

GRAPHS = ("prefill", "decode")
ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
RUNTIME_CACHE = "runtime.cache"  # TensorRT-RTX JIT kernel cache, kept beside the engines


class TrtBackend:
    """The ``trt`` backend; see the module docstring for the buffer layout."""

    name = "trt"

    def __init__(self, artifact_dir: str | Path, manifest: Manifest, cuda_graphs: bool = True) -> None:
        self.dir, self.manifest = Path(artifact_dir), manifest
        self.trt, self.info = load_trt()
        if manifest.plugin_ops:  # engines built with decodert plugin layers
            from decodert.plugins.trt.creators import register_plugins

            register_plugins(self.trt, self.info)
        blobs = {n: read_engine(self.dir, manifest, n, self.info) for n in GRAPHS}  # CPU checks first
        kv, recs = manifest.kv, manifest.engines or {}
        self.layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.head_dims = kv.dims  # each K/V layer's D (Gemma 4: the full layers' differ)
        self.itemsize = ITEMSIZE[manifest.dtype]  # the cache is allocated in the manifest's dtype
        self.max_seq = manifest.max_seq  # cache length (static in the graphs)
        self.max_batch = min(recs["decode"].max_batch or manifest.max_batch, recs["prefill"].max_batch or manifest.max_batch)
        self.max_prefill = recs["prefill"].max_seq or manifest.max_seq  # longest prefill chunk the profile allows
        self.vocab_size = manifest.model.vocab_size
        self.cuda_graphs = cuda_graphs
        self.stats = {"graph_launches": 0, "plain_runs": 0, "captures": 0, "capture_failures": 0, "verify_runs": 0}
        self._open_device(0)  # the first visible GPU (CUDA_VISIBLE_DEVICES picks another)
        self.stream = cm.Stream()
        self.logger = make_logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self.runtime_cache: Any = None
        self.engines = {n: Engine(self, n, blobs[n]) for n in GRAPHS}
        self._load_runtime_cache()
        self.images: Any = None  # the image store runtime/vision/encoder.py sets; read by image_inputs and mrope
        widths = {"prefill": self.max_prefill, "decode": 1, "verify": verify_width(self)}
        self.mrope = RopeOffsets(self, widths) if takes_offsets(manifest) else None  # runtime/backends/trt/mrope.py
        self.image_inputs, self.vision = open_images(self)  # runtime/backends/trt/images.py (None: no images)
        self.takes_images = self.vision is not None
        self.audio = open_audio(self, self.image_inputs)  # audio.engine, its rows placed as image rows (or None)
        self.takes_audio = self.audio is not None  # read by runtime/audio/encoder.py Audio.attach
        encoders = [r.engine for r in (self.vision, self.audio) if r is not None]
        scratch = [e.scratch_bytes for e in (*self.engines.values(), *encoders)]
        self.scratch = cm.DeviceBuffer(max(scratch))
        self._alloc_io()
        self._prefill_ctx = self.engines["prefill"].context(self.scratch)
        self._runs_ctx = self.engines["decode"].context(self.scratch)  # decode of non-prefix slots
        self.baked = BakedCaches()  # each recent cache's decode contexts and CUDA graphs (runtime/backends/trt/baked.py)
        self.cache: KVCache | None = None
        self.verifier = TrtVerifier(self)  # opens the verify engine at the first verify pass

    # ------------------------------------------------------------ setup
    def _open_device(self, device: int) -> None:
        if cm.gpu_count() <= device:
            raise DecodertError(f"no CUDA GPU {device} is visible (nvidia-smi?); use --backend ort on this machine")
        cm.set_device(device)
        self.device = cm.device_info(device)

    def check_validity(self, path: Path, blob: bytes) -> None:
        """TensorRT-RTX can tell whether a plan runs on this GPU/driver before deserializing it."""
        if not self.info.has_engine_validity:
            return
        validity, diagnostics = self.runtime.get_engine_validity(blob)
        if validity == self.trt.EngineValidity.INVALID:
            enum = self.trt.EngineInvalidityDiagnostics
            why = [m for m in dir(enum) if m.isupper() and int(diagnostics) & int(getattr(enum, m))]
            raise DecodertError(f"{path}: {self.info.describe()} cannot run this engine on {self.device['name']} "
                                f"({self.device['compute_capability']}): {', '.join(why) or 'invalid'}")

    def _load_runtime_cache(self) -> None:
        if not self.info.has_runtime_cache:
            return
        self.runtime_cache = self.engines["decode"].engine.create_runtime_config().create_runtime_cache()
        path = self.dir / RUNTIME_CACHE
        if path.is_file() and not self.runtime_cache.deserialize(path.read_bytes()):
            warnings.warn(f"{path}: stale runtime cache (other GPU/driver/version) ignored", stacklevel=2)
        for eng in self.engines.values():
            eng.runtime_cache = self.runtime_cache

    def _alloc_io(self) -> None:
        b, sp, v = self.max_batch, self.max_prefill, self.vocab_size
        host = {"pre_ids": (b * sp,), "pre_len": (b,), "pre_seq": (b,), "dec_ids": (b,), "dec_len": (b,), "next": (b,)}
        self.h = {k: cm.PinnedArray(shape, np.int64) for k, shape in host.items()}
        self.h["logits"] = cm.PinnedArray((b, v), np.float32)
        dev = {"pre_ids": b * sp * 8, "pre_len": b * 8, "pre_seq": b * 8, "dec_ids": b * 8, "dec_len": b * 8,
               "dec_seq": b * 8, "next": b * 8, "logits": b * v * 4}
        # an export with --hidden-states (a draft head reads them on the ort backend): every output must be bound
        self.hidden_bytes = hidden_width(self.manifest) * self.itemsize
        if any(t.name == "hidden_state" for t in self.manifest.graphs["prefill"].outputs):
            dev["hidden_state"] = b * self.hidden_bytes
        if any(t.name == "prompt_hidden" for t in self.manifest.graphs["prefill"].outputs):
            dev["prompt_hidden"] = b * sp * self.hidden_bytes
        self.d = {k: cm.DeviceBuffer(n) for k, n in dev.items()}
        ones = cm.PinnedArray((b,), np.int64)
        ones.array[:] = 1  # decode seq_lengths: always one new token per row
        cm.copy_async(self.d["dec_seq"].ptr, ones.ptr, b * 8, self.stream, "h2d")
        self.stream.sync()
        ones.free()

    def _io_addresses(self, kind: str) -> dict[str, int]:
        pre = kind == "prefill"
        return {"input_ids": self.d["pre_ids" if pre else "dec_ids"].ptr,
                "past_lengths": self.d["pre_len" if pre else "dec_len"].ptr,
                "seq_lengths": self.d["pre_seq" if pre else "dec_seq"].ptr,
                "logits": self.d["logits"].ptr, "next_token": self.d["next"].ptr,
                **({"hidden_state": self.d["hidden_state"].ptr} if "hidden_state" in self.d else {}),
                **({"prompt_hidden": self.d["prompt_hidden"].ptr} if pre and "prompt_hidden" in self.d else {}),
                **(self.mrope.address(kind) if self.mrope is not None else {})}

    def kv_addresses(self, cache: KVCache, row0: int) -> dict[str, int]:
        """past_* and present_* of every layer -> the same pointer, at slot ``row0``."""
        out = {}
        for i, (past, present) in enumerate(self.engines["decode"].kv_pairs):
            out[past] = out[present] = cache.pointer(i, row0)
        for j, name in enumerate(cache.state_names):  # hybrid models: conv / recurrent states, in place too
            out[f"past_{name}"] = out[f"present_{name}"] = cache.state_pointer(j, row0)
        return out

    def io_shapes(self, n: int, seq: int) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"input_ids": (n, seq), "past_lengths": (n,), "seq_lengths": (n,)}
        dims = [d for d in self.head_dims for _ in range(2)]  # k0, v0, k1, ...
        shapes.update({past: (n, self.kv_heads, self.max_seq, d)
                       for (past, _), d in zip(self.engines["decode"].kv_pairs, dims)})
        shapes.update({f"past_{st.io_name}": (n, *map(int, st.shape[1:])) for st in self.manifest.kv.states})
        if self.mrope is not None:
            shapes["rope_offsets"] = (3, n, seq)
        return shapes

    # ------------------------------------------------------------ cache
    def allocate(self, slots: int) -> KVCache:
        """Allocate [slots, Hkv, max_seq, D] K and V per layer once; checked against free GPU memory."""
        if not 1 <= slots <= self.max_batch:
            raise DecodertError(f"allocate({slots}): slots must be 1..{self.max_batch} (the engines' --max-batch)")
        row = self.kv_heads * self.max_seq * sum(self.head_dims) * self.itemsize  # K or V of every layer
        need = 2 * slots * row + self.manifest.kv.state_bytes(slots, self.itemsize)
        free, _ = cm.mem_get_info()
        if need > 0.9 * free:
            raise DecodertError(f"the KV cache needs {need / 2**30:.2f} GiB ({slots} slots x {self.max_seq} tokens) but "
                                f"{free / 2**30:.2f} GiB of GPU memory is free; lower --max-seq or --max-batch")
        cache = KVCache(slots, self.max_seq, self.layers, self.kv_heads, self.head_dim, device="cuda",
                        itemsize=self.itemsize, head_dims=self.head_dims,
                        **self.manifest.kv.cache_layout(self.manifest.dtype))
        self._use(cache)
        return cache

    def _use(self, cache: KVCache) -> None:
        """Make ``cache`` the bound one (its decode contexts and CUDA graphs: runtime/backends/trt/baked.py)."""
        self.cache = cache
        self.baked.use(cache)

    def move_slot(self, cache: KVCache, src: int, dst: int) -> None:
        """Copy slot ``src``'s cached positions into ``dst`` ([Hkv] strided rows of length*D per buffer)."""
        n = int(cache.lengths[src])
        for i in range(len(cache.buffers)):
            pitch = self.max_seq * cache.pos_bytes_of[i]  # bytes between heads
            cm.copy_2d_async(cache.pointer(i, dst), pitch, cache.pointer(i, src), pitch,
                             n * cache.pos_bytes_of[i], self.kv_heads, self.stream)
        for j, nbytes in enumerate(cache.state_bytes):
            cm.copy_async(cache.state_pointer(j, dst), cache.state_pointer(j, src), nbytes, self.stream, "d2d")
        self.stream.sync()
        cache.move(src, dst)

    # ------------------------------------------------------------ KV blocks (runtime/backends/kv_blocks.py)
    def kv_bytes(self, n: int) -> int:
        return 2 * self.kv_heads * n * sum(self.head_dims) * self.itemsize

    def read_kv(self, cache: KVCache, slot: int, start: int, n: int) -> kv_blocks.DeviceBlock:
        """Positions [start, start+n) of ``slot`` copied into a new device block (stays on the GPU)."""
        return kv_blocks.device_read(cache.geometry(), slot, start, n, self.stream)

    def write_kv(self, cache: KVCache, slot: int, start: int, block: kv_blocks.DeviceBlock) -> None:
        kv_blocks.device_write(cache.geometry(), slot, start, block, self.stream)

    def free_kv(self, block: kv_blocks.DeviceBlock) -> None:
        block.free()

    def kv_to_bytes(self, block: kv_blocks.DeviceBlock) -> np.ndarray:
        return kv_blocks.device_bytes(block, self.stream)

    def kv_from_bytes(self, cache: KVCache, data: np.ndarray, n: int) -> kv_blocks.DeviceBlock:
        return kv_blocks.device_from_bytes(cache.geometry(), data, n, self.stream)

    def check_rows(self, cache: KVCache, slots: Sequence[int], counts: Sequence[int]) -> None:
        if len(set(slots)) != len(slots) or any(not 0 <= s < cache.slots for s in slots):
            raise DecodertError(f"slots {list(slots)} must be distinct and within 0..{cache.slots - 1}")
        if min(counts, default=1) < 1:
            raise DecodertError(f"every row needs at least one token, got {list(counts)}")
        cache.check_room(slots, counts)

    # ------------------------------------------------------------ steps
    def prefill(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> StepOutput:
        """Append each row's tokens; prompts longer than the prefill profile run in chunks."""
        self._use(cache)
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in ids]
        self.check_rows(cache, slots, [len(r) for r in rows])
        n, c = len(slots), self.max_prefill
        if self.image_inputs is not None:
            self.image_inputs.check_chunks(rows, c)
        out = StepOutput(np.zeros(n, np.int64), np.zeros((n, self.vocab_size), np.float32) if want_logits else None)
        for start in range(0, max(len(r) for r in rows), c):
            live = [j for j in range(n) if len(rows[j]) > start]  # rows with tokens in this chunk
            chunk = {j: rows[j][start : start + c] for j in live}
            counts = [len(chunk[j]) for j in live]
            for run in fitting_runs([slots[j] for j in live], cache.lengths, counts, self.max_seq):
                self._prefill_run(cache, [(live[i], s) for i, s in run], chunk, out)
        return out

    def _prefill_run(self, cache: KVCache, run: list[tuple[int, int]], chunk: dict[int, np.ndarray],
                     out: StepOutput) -> None:
        k, row0 = len(run), run[0][1]
        lens = np.array([len(chunk[j]) for j, _ in run], np.int64)  # [k]
        seq = int(lens.max())
        ids = self.h["pre_ids"].array[: k * seq].reshape(k, seq)  # [k, S] right-padded
        ids[:] = 0
        for r, (j, _) in enumerate(run):
            ids[r, : lens[r]] = chunk[j]
        if self.mrope is not None:  # each row's offsets after what its slot holds (runtime/backends/trt/mrope.py)
            self.mrope.write("prefill", cache, [(s, chunk[j]) for j, s in run], seq)
        images = self.image_inputs.bind(ids) if self.image_inputs is not None else ({}, {})  # ids -> text ids
        self.h["pre_len"].array[:k] = cache.lengths[row0 : row0 + k]
        self.h["pre_seq"].array[:k] = lens
        for key, nbytes in (("pre_ids", k * seq * 8), ("pre_len", k * 8), ("pre_seq", k * 8)):
            cm.copy_async(self.d[key].ptr, self.h[key].ptr, nbytes, self.stream, "h2d")
        ctx = self._prefill_ctx
        bind(ctx, {**self._io_addresses("prefill"), **self.kv_addresses(cache, row0), **images[0]},
             {**self.io_shapes(k, seq), **images[1]})
        with cache.writing([s for _, s in run], self.stream.sync):  # states and record together (kv_cache.py)
            self.execute(ctx, "prefill")
            self.stats["plain_runs"] += 1
            cm.copy_async(self.h["next"].ptr, self.d["next"].ptr, k * 8, self.stream, "d2h")
            self._collect(run, out)
            cache.commit([s for _, s in run], [chunk[j] for j, _ in run])

    def decode(self, cache: KVCache, slots: Sequence[int], ids: np.ndarray, want_logits: bool) -> StepOutput:
        """One token per slot; slots 0..n-1 take the bound context / CUDA graph path."""
        self._use(cache)
        tokens = np.asarray(ids, dtype=np.int64).reshape(-1)  # [n]
        n = len(slots)
        self.check_rows(cache, slots, [1] * n)
        out = StepOutput(np.zeros(n, np.int64), np.zeros((n, self.vocab_size), np.float32) if want_logits else None)
        if list(slots) == list(range(n)):
            self.h["dec_ids"].array[:n] = tokens
            self.h["dec_len"].array[:n] = cache.lengths[:n]
            if self.mrope is not None:
                self.mrope.write_decode(cache, range(n))
            with cache.writing(range(n), self.stream.sync):
                self._decode_prefix(cache, n)
                self._collect([(j, j) for j in range(n)], out)
                cache.commit(range(n), tokens.reshape(-1, 1))
        else:
            for run in contiguous_runs(slots):
                k, row0 = len(run), run[0][1]
                self.h["dec_ids"].array[:k] = tokens[[j for j, _ in run]]
                self.h["dec_len"].array[:k] = cache.lengths[row0 : row0 + k]
                if self.mrope is not None:
                    self.mrope.write_decode(cache, [s for _, s in run])
                bind(self._runs_ctx, {**self._io_addresses("decode"), **self.kv_addresses(cache, row0)},
                     self.io_shapes(k, 1))
                with cache.writing([s for _, s in run], self.stream.sync):
                    self._decode_enqueue(self._runs_ctx, k)
                    self.stats["plain_runs"] += 1
                    self._collect(run, out)
                    cache.commit([s for _, s in run], tokens[[j for j, _ in run]].reshape(-1, 1))
        return out

    @property
    def verify_width(self) -> int:
        """Tokens one verify call checks per row (0: no verify graph or engine)."""
        return self.verifier.width

    def verify(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> VerifyOutput:
        """Each row's tokens over its cache, the output after every one (runtime/backends/trt/verify.py)."""
        self._use(cache)
        return self.verifier.verify(cache, slots, ids, want_logits)

    def prepare_verify(self, rows: int) -> None:
        """Deserialize the verify engine now, not inside the first pass the speculation planner picks."""
        if self.verifier.width:
            self.verifier.open()

    def _decode_prefix(self, cache: KVCache, n: int) -> None:
        baked = self.baked.now
        if n not in baked.ctx:
            ctx = self.engines["decode"].context(self.scratch)
            bind(ctx, {**self._io_addresses("decode"), **self.kv_addresses(cache, 0)}, self.io_shapes(n, 1))
            baked.ctx[n] = ctx
        ctx = baked.ctx[n]
        if self.cuda_graphs and n in baked.warm and n not in baked.graphs:
            baked.graphs[n] = capture(ctx, self.stream, lambda: self._decode_enqueue(ctx, n), self.stats, n)
        graph = baked.graphs.get(n) if self.cuda_graphs else None
        if graph is not None:
            graph.launch()
            self.stats["graph_launches"] += 1
        else:
            self._decode_enqueue(ctx, n)
            self.stats["plain_runs"] += 1
            baked.warm.add(n)

    def _decode_enqueue(self, ctx: Any, n: int) -> None:
        """[h2d ids, h2d lengths (h2d rope_offsets), execute, d2h next_token]: the work a decode graph replays."""
        cm.copy_async(self.d["dec_ids"].ptr, self.h["dec_ids"].ptr, n * 8, self.stream, "h2d")
        cm.copy_async(self.d["dec_len"].ptr, self.h["dec_len"].ptr, n * 8, self.stream, "h2d")
        if self.mrope is not None:
            self.mrope.enqueue_decode(n)
        self.execute(ctx, "decode")
        cm.copy_async(self.h["next"].ptr, self.d["next"].ptr, n * 8, self.stream, "d2h")

    def execute(self, ctx: Any, what: str) -> None:
        if not ctx.execute_async_v3(self.stream.handle):
            raise DecodertError(f"TensorRT failed to run the {what} engine (set DECODERT_TRT_VERBOSE=1)")

    def _collect(self, run: list[tuple[int, int]], out: StepOutput) -> None:
        """Wait for the step; copy next_token (and logits when asked) of the run's k rows out."""
        k = len(run)
        if out.logits is not None:
            cm.copy_async(self.h["logits"].ptr, self.d["logits"].ptr, k * self.vocab_size * 4, self.stream, "d2h")
        self.stream.sync()
        js = [j for j, _ in run]
        out.next_token[js] = self.h["next"].array[:k]
        if out.logits is not None:
            out.logits[js] = self.h["logits"].array[:k]

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Free GPU memory; save the TensorRT-RTX runtime cache (JIT kernels) beside the engines."""
        if self.runtime_cache is not None:
            try:
                write_atomic(self.dir / RUNTIME_CACHE, bytes(self.runtime_cache.serialize()))
            except OSError as e:  # a read-only artifact folder just loses the cache
                warnings.warn(f"could not save {self.dir / RUNTIME_CACHE}: {e}", stacklevel=2)
        self.baked.drop()
        self.verifier.close()
        for part in [p for p in (self.image_inputs, self.vision, self.audio, self.mrope) if p is not None]:
            part.free()
        self._prefill_ctx = self._runs_ctx = None
        if self.cache is not None:
            self.cache.free()
        buffers: list[cm.PinnedArray | cm.DeviceBuffer] = [*self.h.values(), *self.d.values(), self.scratch]
        for buf in buffers:
            buf.free()
        self.stream.destroy()

    def __enter__(self) -> "TrtBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
