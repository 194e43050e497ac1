"""ONNX Runtime backend: one session per graph it needs, a cache bound in place.

- On ONNX Runtime the prefill graph also serves decode steps (a decode step is a prefill of one
  token), so only one session loads and prepacks the weights; ``separate_decode=True`` runs the
  exported decode graph instead (tests use it to check that graph too). Measured on SmolLM2-135M:
  two sessions held 1.34 GiB RSS, one session about half of that.
- The KV cache is one numpy buffer per layer and K/V, [slots, H_kv, max_seq, D], allocated once.
  A call over slots [a, a+n) binds the views ``buf[a:a+n]`` as both past and present: the graph
  writes only the new positions, nothing is copied or allocated per step.
- Decode keeps one IOBinding per slot range with fixed input/output buffers; a step writes the
  new token ids and lengths into them and runs.
- Per-phase placement (runtime/backends/placement.py, docs/features/placement.md): ``phases`` may put the
  prefill on OpenVINO's own runtime over this prefill graph (``openvino-native``: each call's new K/V rows
  copied into the cache buffers; ``openvino-sdpa`` / ``openvino-paged``: the same, its attention lowered to
  OpenVINO's SDPA / PagedAttention), or
  the prefill or the decode step on the OpenVINO execution provider (``openvino``: the artifact's portable
  prefill graph, ``manifest.phase_graphs["prefill.portable"]`` or a portable artifact's prefill.onnx, bound to
  the same buffers); or the decode step and the verify passes on decodert's own C step (``native-cpu``,
  runtime/backends/native/: every row's tokens in one call, written into the rows' K/V in the same buffers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from decodert.errors import DecodertError, first_line
from decodert.artifact.graph_contract import kv_storage
from decodert.artifact.manifest import Manifest
from decodert.artifact.heads import hidden_width
from decodert.plugins.ops.kv_dtypes import NUMPY_STORAGE
from decodert.artifact.targets import target_info
from decodert.artifact.onnx_check import check_external_data, check_session_io
from decodert.runtime.backends import image_feeds, kv_blocks
from decodert.runtime.backends.backend import StepOutput, VerifyOutput, window_outputs
from decodert.runtime.backends.hidden_rows import HiddenRows
from decodert.runtime.backends.kv_cache import KVCache, contiguous_runs, fitting_runs
from decodert.runtime.backends.ort_session import default_providers, open_session, session_options
from decodert.runtime.backends.memory import check_kv_fits, check_weights_fit, kv_cache_bytes
from decodert.runtime.backends.ort.verify import VerifyState, bind_cache
from decodert.runtime.vision.tokens import is_image

NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}
# the prefill candidates on OpenVINO's own runtime over this prefill graph -> how its GroupQueryAttention is
# translated: by OpenVINO's frontend, or by runtime/backends/openvino/lowering.py into SDPA or PagedAttention
OPENVINO_RUNTIME = {"openvino-native": "frontend", "openvino-sdpa": "sdpa", "openvino-paged": "paged"}


@dataclass
class _Binding:
    """An IOBinding for slots [start, start+n) with fixed buffers for the per-step inputs/outputs."""

    io: Any
    ids: np.ndarray  # [n, S] int64
    past: np.ndarray  # [n] int64
    seq: np.ndarray  # [n] int64
    logits: np.ndarray  # [n, V] float32
    next_token: np.ndarray  # [n] int64
    images: Any = None  # {input name: array} of the image rows bound for this call (runtime/backends/image_feeds.py)
    offsets: Any = None  # [3, n, S] int64 M-RoPE rope_offsets (runtime/vision/mrope.py), bound once
    hidden: Any = None  # [n, hidden] the last hidden state, bound when a draft head reads it (keep_hidden)
    prompt: Any = None  # [n, S, hidden] every position's (prefill graphs with prompt_hidden), bound with it


class OrtBackend:
    name = "ort"

    def __init__(self, artifact_dir: str | Path, manifest: Manifest, threads: int | None = None,
                 providers: Sequence[str] | None = None, separate_decode: bool = False,
                 phases: dict[str, str] | None = None):
        """``phases``: phase ("prefill" | "decode") -> "ort" | "openvino" | one of ``OPENVINO_RUNTIME``
        (prefill only) | "native-cpu" (decode only); default: both on ``providers``."""
        self.dir = Path(artifact_dir)
        self.manifest = manifest
        if manifest.dtype not in NP_DTYPES:
            raise DecodertError(f"{self.dir}: dtype {manifest.dtype} is not supported by ONNX Runtime here; "
                                "export with --dtype fp32 (or fp16), or run it with TensorRT")
        self.np_dtype = NP_DTYPES[manifest.dtype]
        kv = manifest.kv
        self.layers, self.kv_heads, self.head_dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
        self.kv = kv_storage(manifest)  # the cache's element type: float, int8, fp8 or packed int4 codes
        self.kv_width = self.kv.width(self.head_dim)  # the buffers' last dimension
        self.head_dims = kv.dims  # each K/V layer's D (Gemma 4: the full layers' differ)
        self.max_batch, self.max_seq = manifest.max_batch, manifest.max_seq
        self.vocab_size = manifest.model.vocab_size
        self.hidden = manifest.model.hidden_size or 0
        self.hidden_width = hidden_width(manifest)  # a row of the hidden-state outputs (EAGLE-3 features: 3 hidden)
        options = session_options(threads)
        providers = list(providers or default_providers())
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        self._stream: Any = None
        self._kinds = ("prefill", "decode") if separate_decode else ("prefill",)
        weights = self.dir / manifest.weights.file
        if weights.is_file():  # check_external_data names a missing one
            check_weights_fit(weights.stat().st_size, *manifest.model.experts)
        self._options, self._providers = options, providers
        self.phase_sessions: dict[str, Any] = {}
        self.sessions: dict[str, Any] = {}
        self._target_prefill: Any = None
        if not _without_ort(phases or {}):  # else they are not opened at all (drop_unplaced)
            self._open_ort()
        # GroupQueryAttention (ort target) accepts a multi-token step with a non-empty cache only at batch 1.
        self._prefill_with_past_batch = target_info(manifest.target).multi_token_rows or self.max_batch
        self.placed = {"prefill": "ort", "decode": "ort"}  # phase -> what runs it (inspect, the metrics line)
        if not self.phase_sessions:  # each phase placed where the ort sessions are not needed (below)
            self.placed.update(phases or {})
        # a long one-row prompt runs in chunks of this many tokens (0: in one call): GQA's CPU prefill
        # attends over the whole square, so 512-token chunks cut its share of a 4096-token prompt
        # by about a fifth while the GEMMs stay large (docs/benchmarks/history.md, "Sizes users deploy (issue 32)")
        self.prefill_chunk = int(os.environ.get("DECODERT_PREFILL_CHUNK", "512"))
        self._decode_bindings: dict[tuple[int, int, int], _Binding] = {}
        # verify passes (speculative decoding): "verify" opened on first use or by prepare_verify;
        # "prefill" (one-row passes where the prefill graph takes per_position) is the prefill session
        self._verify: dict[str, VerifyState] = {}
        self._prefill_verifies = manifest.graphs["prefill"].verifies_rows
        self._windows = window_outputs(manifest)  # conv state name -> K-1: per-position states of a verify pass
        # vision-language: the image store (runtime/vision/encoder.py) whose rows a prefill binds at its image ids
        self.images: Any = None
        self.takes_images = any(t.name == "image_embeds" for t in manifest.graphs["prefill"].inputs)  # read by Vision.attach
        self.takes_audio = self.takes_images  # audio rows are placed as image rows (read by Audio.attach)
        self._mrope = any(t.name == "rope_offsets" for t in manifest.graphs["prefill"].inputs)  # Qwen-VL
        images = manifest.model.images
        self._deepstack = images.deepstack_layers if images is not None else 0  # Qwen3-VL: bound with the images
        # Gemma 3: an image's tokens see each other, so one call holds all of them (no chunk cuts an image)
        self._image_ahead = any(t.name == "image_ahead" for t in manifest.graphs["prefill"].inputs)
        # LoRA slots (--lora-slots): the stacked adapter inputs, bound once; runtime/adapters.py writes them
        layout = manifest.lora_layout
        self.lora_weights = None if layout is None else layout.allocate(manifest.model.spec(), self.np_dtype)
        self.hidden_rows: HiddenRows | None = None  # the last hidden states per slot, once a draft head asks
        for phase, name in (phases or {}).items():
            self.place(phase, name, threads)

    def _open_ort(self) -> None:
        """The ort sessions of the artifact's graphs (the decode on the prefill's session unless separate_decode)."""
        self.sessions = {}
        for kind in self._kinds:
            path = self.dir / self.manifest.graphs[kind].file
            check_external_data(path)
            self.sessions[kind] = open_session(path, self._options, self._providers)
            check_session_io(self.sessions[kind], self.manifest.graphs[kind], path)
        self.sessions.setdefault("decode", self.sessions["prefill"])
        self._target_prefill = self.sessions["prefill"]  # one-row verify passes (per_position) run on it
        self.phase_sessions["ort"] = {k: self.sessions[k] for k in ("prefill", "decode")}

    def keep_hidden(self) -> HiddenRows:
        """Bind the graphs' hidden-state outputs from now on and keep each slot's (runtime/backends/hidden_rows.py)."""
        if not any(t.name == "hidden_state" for t in self.manifest.graphs["prefill"].outputs):
            raise DecodertError(f"{self.dir}: its graphs do not return the hidden state a draft head reads; "
                                "export it again with --hidden-states")
        if any(name != "ort" for name in self.placed.values()):
            raise DecodertError(f"a draft head reads the hidden state of every pass, which only the ort sessions "
                                f"return; load {self.dir} with placement='off' (--placement off)")
        if self.hidden_rows is None:
            self.hidden_rows = HiddenRows()
            self._decode_bindings.clear()
            self._verify.clear()
        return self.hidden_rows

    def place(self, phase: str, name: str, threads: int | None = None) -> None:
        """Run ``phase`` ("prefill" | "decode") on ``name`` ("ort" | "openvino" | one of ``OPENVINO_RUNTIME``) from now on, over the same
        cache buffers (a session opened once per name; bindings made for another session are dropped)."""
        if phase not in self.placed or name not in ("ort", "openvino", *OPENVINO_RUNTIME, "native-cpu"):
            raise DecodertError(f"cannot place {phase!r} on {name!r}: phases are prefill and decode, "
                                f"backends ort, openvino, {', '.join(OPENVINO_RUNTIME)} and native-cpu")
        if "ort" not in self.phase_sessions and not _without_ort({**self.placed, phase: name}):  # closed till now
            self._open_ort()
            for other, runs in self.placed.items():
                if runs == "openvino":  # the EP's session stays where it was placed
                    self.sessions[other] = self.phase_sessions["openvino"][other]
        if name == "native-cpu":
            if phase != "decode":
                raise DecodertError("native-cpu runs the decode step and the verify passes only (decodert's own C step)")
            if name not in self.phase_sessions:
                from decodert.runtime.backends.native.step import NativeDecode

                self.phase_sessions[name] = {"decode": NativeDecode(self.dir, self.manifest, threads)}
            self.placed[phase] = name
            return
        if name in OPENVINO_RUNTIME:
            if phase != "prefill":
                raise DecodertError(f"{name} runs the prefill only (it copies each call's new rows into the cache)")
            if name not in self.phase_sessions:
                from decodert.runtime.backends.openvino.native import NativePrefill

                runner = NativePrefill(self.dir / self.manifest.graphs["prefill"].file, threads,
                                       exact=self.manifest.quant is None, lowering=OPENVINO_RUNTIME[name])
                runner.warm(self._new_cache(1, min(self.max_seq, runner.warm_rows())), self.vocab_size, self.max_seq)
                self.phase_sessions[name] = {"prefill": runner}
            self.placed[phase] = name
            return
        if name not in self.phase_sessions:
            from decodert.runtime.backends.openvino import ep

            graph, path = portable_prefill(self.dir, self.manifest)
            session = ep.open_session(path, session_options(threads), threads, exact=self.manifest.quant is None)
            check_session_io(session, graph, path)
            self.phase_sessions[name] = {"prefill": session, "decode": session}
        self.sessions[phase] = self.phase_sessions[name][phase]
        self.placed[phase] = name
        if phase == "prefill":  # the portable graph takes any rows over a cache; GroupQueryAttention one
            info = target_info("portable" if name == "openvino" else self.manifest.target)
            self._prefill_with_past_batch = info.multi_token_rows or self.max_batch
        else:
            self._decode_bindings.clear()

    def drop_unplaced(self) -> None:
        """Close the sessions no phase runs on any more (after a measurement tried them). The ort sessions too where
        nothing runs on them (the prefill on OpenVINO's own runtime, the decode and verify passes on native-cpu; no
        image or audio rows, no draft head): the 1B shape's int4 weights a third time (1.24 GB) otherwise. A later
        ``place(..., "ort")`` opens them again."""
        used = set(self.placed.values())
        for name in [n for n in self.phase_sessions if n not in used and n != "ort"]:
            del self.phase_sessions[name]
        if _without_ort(self.placed) and self.images is None and self.hidden_rows is None and "ort" in self.phase_sessions:
            del self.phase_sessions["ort"]
            self.sessions, self._target_prefill = {}, None
            self._decode_bindings.clear()
            self._verify.clear()

    # ---- Backend protocol --------------------------------------------------------------------
    def allocate(self, slots: int | None = None) -> KVCache:
        slots = slots or self.max_batch
        if not 1 <= slots <= self.max_batch:
            raise DecodertError(f"batch {slots} exceeds the artifact's --max-batch {self.max_batch}")
        check_kv_fits(kv_cache_bytes(slots, self.max_seq, self.layers, self.kv_heads, self.head_dims, self.kv)
                      + self.manifest.kv.state_bytes(slots, np.dtype(self.np_dtype).itemsize), self.kv)
        self._decode_bindings.clear()
        for state in self._verify.values():
            state.bindings.clear()
        return self._new_cache(slots, self.max_seq)

    def _new_cache(self, slots: int, max_seq: int) -> KVCache:
        return KVCache(slots, max_seq, self.layers, self.kv_heads, self.kv_width, NUMPY_STORAGE[self.kv.storage],
                       self.device, head_dims=[self.kv.width(d) for d in self.head_dims],
                       **self.manifest.kv.cache_layout(self.manifest.dtype))

    def prefill(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> StepOutput:
        lens = np.array([len(x) for x in ids], np.int64)
        cache.check_room(slots, lens, "the prompt's tokens")
        out = StepOutput(np.empty(len(slots), np.int64),
                         np.empty((len(slots), self.vocab_size), np.float32) if want_logits else None)
        if self.placed["prefill"] in OPENVINO_RUNTIME:
            return self._prefill_native(cache, slots, ids, out, want_logits)
        for rows in self._prefill_groups(cache, slots, lens):
            start, n = slots[rows[0]], len(rows)
            whole = self._image_ahead and bool(is_image(ids[rows[0]]).any())  # image tokens see later ones
            done = self._prefill_chunks(cache, start, ids[rows[0]]) if n == 1 and self.prefill_chunk and not whole else 0
            width = int(lens[rows].max()) - done
            b = self._bind(cache, "prefill", start, n, width)
            b.ids[:] = 0
            for j, r in enumerate(rows):
                b.ids[j, : lens[r] - done] = ids[r][done:]
                self._set_offsets(b, j, cache, slots[r], ids[r][done:])
            b.past[:] = cache.lengths[start : start + n]
            b.seq[:] = lens[rows] - done
            self._bind_images(b)
            group = [slots[r] for r in rows]
            self._bind_late(b, "prefill", cache, start, n)
            with cache.writing(group):  # a row's states and its record change together (kv_cache.py)
                _run_bound(self.sessions["prefill"], b.io, self.dir, "prefill")
                cache.commit(group, [ids[r][done:] for r in rows])
            self._keep_last(cache, group, b)
            _gather(out, rows, b, want_logits)
        return out

    def _prefill_native(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], out: StepOutput,
                        want_logits: bool) -> StepOutput:
        """Each row's whole prompt in one OpenVINO call (runtime/backends/openvino/native.py), committed after it."""
        runner = self.phase_sessions[self.placed["prefill"]]["prefill"]
        for j, slot in enumerate(slots):
            with cache.writing([slot]):
                logits = runner.run(cache, slot, np.asarray(ids[j], np.int64))
                cache.commit([slot], [ids[j]])
            b = _Binding(None, None, None, None, logits[None], np.array([int(np.argmax(logits))], np.int64))
            _gather(out, [j], b, want_logits)
        return out

    def _prefill_chunks(self, cache: KVCache, start: int, row: np.ndarray) -> int:
        """All but the last ``prefill_chunk`` tokens of one row's prompt, a chunk per call (GQA takes
        several tokens over a non-empty cache at batch 1), each committed after its call; returns how
        many were run."""
        chunk, done, b = self.prefill_chunk, 0, None
        while len(row) - done > chunk:
            b = b or self._bind(cache, "prefill", start, 1, chunk)
            b.ids[0] = row[done : done + chunk]
            self._set_offsets(b, 0, cache, start, row[done : done + chunk])
            b.past[:] = cache.lengths[start]
            b.seq[:] = chunk
            self._bind_images(b)
            self._bind_late(b, "prefill", cache, start, 1)
            with cache.writing([start]):
                _run_bound(self.sessions["prefill"], b.io, self.dir, "prefill")
                cache.commit([start], [row[done : done + chunk]])
            done += chunk
        return done

    def decode(self, cache: KVCache, slots: Sequence[int], ids: np.ndarray, want_logits: bool) -> StepOutput:
        cache.check_room(slots, [1] * len(slots), "the next tokens")
        out = StepOutput(np.empty(len(slots), np.int64),
                         np.empty((len(slots), self.vocab_size), np.float32) if want_logits else None)
        if self.placed["decode"] == "native-cpu":  # every row in one C call, each as it would run alone
            best, logits = self._native_pass(cache, list(slots), [ids[j : j + 1] for j in range(len(slots))])
            _gather(out, list(range(len(slots))), _Binding(None, None, None, None, logits, best), want_logits)
            return out
        for rows in contiguous_runs(slots):
            start, n = slots[rows[0]], len(rows)
            key = (id(cache), start, n)
            b = self._decode_bindings.get(key)
            if b is None:
                b = self._decode_bindings[key] = self._bind(cache, "decode", start, n, 1)
            b.ids[:, 0] = ids[rows]
            b.past[:] = cache.lengths[start : start + n]
            if b.offsets is not None:  # each row's next text position (runtime/vision/mrope.py)
                b.offsets[:, :, 0] = [image_feeds.next_offset(cache.held(start + j), self.images) for j in range(n)]
            run = [slots[r] for r in rows]
            self._bind_late(b, "decode", cache, start, n)
            with cache.writing(run):
                _run_bound(self.sessions["decode"], b.io, self.dir, "decode")
                cache.commit(run, ids[rows].reshape(-1, 1))
            self._keep_last(cache, run, b)
            _gather(out, rows, b, want_logits)
        return out

    def _native_pass(self, cache: KVCache, slots: list[int], ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Rows' ids at their next positions on decodert's C step (runtime/backends/native/step.py), which writes
        their K/V in the same buffers; the ids are committed after it, inside ``writing``, as the ort step does.
        (argmax, logits) of every id, row after row."""
        native = self.phase_sessions["native-cpu"]["decode"]
        with cache.writing(slots):
            best, logits = native.forward(cache, slots, ids)
            cache.commit(slots, [np.asarray(x, np.int64).reshape(-1) for x in ids])
        return best, logits

    @property
    def verify_matches_decode(self) -> bool:
        """Does a verify pass score a row as this backend's decode step does? On ort (the verify graph) and on
        native-cpu (its verify is the same C step over the row's next positions, bit for bit); not where the decode
        runs on the OpenVINO EP (other rounding, so a verify could accept a token the plain step would not choose at
        a near tie): speculation then runs plain steps (runtime/speculation/speculative.py)."""
        return self.placed["decode"] in ("ort", "native-cpu")

    @property
    def verify_width(self) -> int:
        """Tokens one verify call checks per row (0: the artifact has no verify graph)."""
        graph = self.manifest.graphs.get("verify")
        return (graph.max_tokens or 0) if graph else 0

    def verify(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> VerifyOutput:
        """Rows over their caches; a one-row run through the prefill session where its graph verifies
        rows (GroupQueryAttention, no second copy of the weights), else through graphs.verify: several
        rows at once where it takes several rows over caches (batched_past), else row by row. With the decode on
        native-cpu, every row's ids in the C step (its verify is its decode, position by position)."""
        if "verify" not in self.manifest.graphs:
            self._open_verify()  # says what to do
        lens = np.array([len(x) for x in ids], np.int64)  # [n]
        width = int(lens.max())
        if not 1 <= lens.min() or width > self.verify_width:
            raise DecodertError(f"verify takes 1..{self.verify_width} tokens per row, got {lens.tolist()}")
        cache.check_room(slots, lens, "the verified tokens")
        out = VerifyOutput(np.zeros((len(slots), width), np.int64),
                           np.zeros((len(slots), width, self.vocab_size), np.float32) if want_logits else None)
        if self.placed["decode"] == "native-cpu":  # scored by the step that decodes (verify_matches_decode)
            best, logits = self._native_pass(cache, list(slots), [np.asarray(x, np.int64) for x in ids])
            if out.logits is None and not _chosen_finite(logits, best):  # the scores go with the pass, as _gather does
                out.logits = np.zeros((len(slots), width, self.vocab_size), np.float32)
            at = np.concatenate([[0], np.cumsum(lens)])
            for j in range(len(slots)):
                out.next_tokens[j, : lens[j]] = best[at[j] : at[j + 1]]
                if out.logits is not None:
                    out.logits[j, : lens[j]] = logits[at[j] : at[j + 1]]
            return out
        if self._windows:  # every row runs alone (below): its windows are kept per row
            out.windows = [{} for _ in slots]
        batched = self.manifest.graphs["verify"].batched_past
        runs = fitting_runs(slots, cache.lengths, lens, cache.max_seq) if batched else self._prefill_groups(cache, slots, lens)
        if cache.has_state:  # a padded position would enter a row's conv/recurrent state: rows run unpadded, alone
            runs = [[j] for run in runs for j in run]
        for rows in runs:  # a padded run never writes past the end of a row's context
            state = self._verify_state(len(rows) == 1)
            start, n, w = slots[rows[0]], len(rows), int(lens[rows].max())
            io, ids_buf, past_buf, logits_buf, next_buf, wins = state.binding(cache, start, n, w)
            ids_buf[:] = 0
            offsets = state.offsets_view(n, w)
            for j, r in enumerate(rows):
                ids_buf[j, : lens[r]] = ids[r]
                image_feeds.set_offsets(offsets, j, cache.held(slots[r]), ids[r], self.images)  # M-RoPE
            past_buf[:] = cache.lengths[start : start + n]
            run = [slots[r] for r in rows]
            with cache.writing(run):
                _run_bound(state.session, io, self.dir, state.kind)
                cache.commit(run, [ids[r] for r in rows])
            if self.hidden_rows is not None:  # every fed position's hidden state (the drafter picks the accepted one)
                for j, r in enumerate(rows):
                    self.hidden_rows.put(slots[r], past_buf[j], state.hidden_view(n, w)[j, : lens[r]])
            out.next_tokens[rows, :w] = next_buf
            if out.logits is None and not _chosen_finite(logits_buf, next_buf):  # as _gather does
                out.logits = np.zeros((len(slots), width, self.vocab_size), np.float32)
            if out.logits is not None:
                out.logits[rows, :w] = logits_buf
            if out.windows is not None:
                out.windows[rows[0]] = {name: buf[0].copy() for name, buf in wins.items()}
        return out

    def prepare_verify(self, rows: int) -> None:
        if "verify" in self.manifest.graphs and self.placed["decode"] != "native-cpu":
            self._verify_state(rows == 1)

    def _verify_state(self, one_row: bool) -> VerifyState:
        """The prefill graph for one row where it verifies rows, unless the verify graph outputs conv windows."""
        kind = "prefill" if one_row and self._prefill_verifies and not self._windows else "verify"
        state = self._verify.get(kind)
        if state is None:
            session = self._target_prefill if kind == "prefill" else self._open_verify()
            state = self._verify[kind] = VerifyState(session, kind, self.max_batch, self.verify_width, self.vocab_size,
                                                     self._windows if kind == "verify" else None, self.lora_weights,
                                                     (self.hidden_width, self.np_dtype) if self.hidden_rows is not None else None)
        return state

    def open_graph(self, file: str) -> ort.InferenceSession:
        """A session for another graph of the artifact (``vision.onnx``), with this backend's options and providers."""
        return open_session(Path(self.dir) / file, self._options, self._providers)

    def _open_verify(self) -> ort.InferenceSession:
        graph = self.manifest.graphs.get("verify")
        if graph is None:
            raise DecodertError(f"{self.dir} has no verify graph (exported before speculative decoding); "
                                "re-export it to use speculative decoding")
        path = self.dir / graph.file
        check_external_data(path)
        session = open_session(path, self._options, self._providers)
        check_session_io(session, graph, path)
        return session

    def move_slot(self, cache: KVCache, src: int, dst: int) -> None:
        if src == dst:
            return
        n = int(cache.lengths[src])
        if cache.device == "cpu":
            for buf in cache.buffers:
                buf[dst, :, :n] = buf[src, :, :n]
            for buf in cache.states:
                buf[dst] = buf[src]
        else:
            from decodert.plugins.cuda_mem import copy_async

            stream = self._cuda_stream()
            for i in range(len(cache.buffers)):
                copy_async(cache.pointer(i, dst), cache.pointer(i, src), cache.slot_bytes_of[i], stream, "d2d")
            for j, nbytes in enumerate(cache.state_bytes):
                copy_async(cache.state_pointer(j, dst), cache.state_pointer(j, src), nbytes, stream, "d2d")
            self._stream.sync()
        cache.move(src, dst)
        if self.hidden_rows is not None:
            self.hidden_rows.move(src, dst)

    # ---- KV blocks (runtime/backends/kv_blocks.py) ----------------------------------------------------
    def kv_bytes(self, n: int) -> int:
        return kv_cache_bytes(1, n, self.layers, self.kv_heads, self.head_dims, self.kv)

    def read_kv(self, cache: KVCache, slot: int, start: int, n: int) -> Any:
        if cache.device == "cpu":
            return kv_blocks.host_read(cache.buffers, slot, start, n)
        return kv_blocks.device_read(cache.geometry(), slot, start, n, self._cuda_stream())

    def write_kv(self, cache: KVCache, slot: int, start: int, block: Any) -> None:
        if cache.device == "cpu":
            kv_blocks.host_write(cache.buffers, slot, start, block)
        else:
            kv_blocks.device_write(cache.geometry(), slot, start, block, self._cuda_stream())

    def free_kv(self, block: Any) -> None:
        kv_blocks.free_block(block)

    def kv_to_bytes(self, block: Any) -> np.ndarray:
        if isinstance(block, kv_blocks.DeviceBlock):
            return kv_blocks.device_bytes(block, self._cuda_stream())
        return kv_blocks.host_bytes(block)

    def kv_from_bytes(self, cache: KVCache, data: np.ndarray, n: int) -> Any:
        if cache.device == "cpu":
            return kv_blocks.host_from_bytes(cache.buffers, data, n)
        return kv_blocks.device_from_bytes(cache.geometry(), data, n, self._cuda_stream())

    def _cuda_stream(self) -> Any:
        from decodert.plugins.cuda_mem import Stream

        self._stream = self._stream or Stream()
        return self._stream

    # ---- binding -----------------------------------------------------------------------------
    def _keep_last(self, cache: KVCache, slots: list[int], b: _Binding) -> None:
        """With a draft head: each row's last hidden state, at its last cached position."""
        if self.hidden_rows is not None and b.prompt is not None:  # every position the call ran
            for j, slot in enumerate(slots):
                w = int(b.seq[j])
                self.hidden_rows.put(slot, int(cache.lengths[slot]) - w, b.prompt[j, :w])
        elif self.hidden_rows is not None and b.hidden is not None:
            for j, slot in enumerate(slots):
                self.hidden_rows.put(slot, int(cache.lengths[slot]) - 1, b.hidden[j : j + 1])

    def _bind_late(self, b: _Binding, kind: str, cache: KVCache, start: int, n: int) -> None:
        """Where ``kind`` runs on the OpenVINO EP, bind the call's inputs again now that they are written: its
        IOBinding copies an input into the provider's memory when it is bound (measured: a prefill bound before
        its ids were written ran on zeros), so the ids, lengths and the rows' K/V (a copy of the slots' whole
        cache, [n, H_kv, max_seq, D] per layer: 26 ms for SmolLM2 at max_seq 2048) are bound just before
        the run. Its outputs land in the bound buffers (the present K/V in the cache itself)."""
        if self.placed[kind] == "ort":
            return
        for name, arr in (("input_ids", b.ids), ("past_lengths", b.past), ("seq_lengths", b.seq)):
            b.io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        if b.offsets is not None:
            b.io.bind_input("rope_offsets", "cpu", 0, b.offsets.dtype, b.offsets.shape, b.offsets.ctypes.data)
        bind_cache(b.io, cache, start, n, self.lora_weights)

    def _set_offsets(self, b: _Binding, j: int, cache: KVCache, slot: int, new: np.ndarray) -> None:
        """Row ``j``'s M-RoPE offsets for ``new`` ids, written after what ``slot`` holds."""
        if b.offsets is not None:
            image_feeds.set_offsets(b.offsets, j, cache.held(slot), new, self.images)

    def _bind_images(self, b: _Binding) -> None:
        """Image ids in ``b.ids`` (runtime/vision/tokens.py) -> the ``<image>`` token, their rows bound as
        image_embeds at image_positions (empty when none: the binding may be reused chunk after chunk)."""
        if not self.takes_images:
            return
        arrays = image_feeds.image_arrays(b.ids, self.images, self.hidden, self.np_dtype, self._deepstack,
                                          self._image_ahead)
        b.images = arrays  # kept alive while bound
        for name, arr in arrays.items():
            b.io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)

    def _prefill_groups(self, cache: KVCache, slots: Sequence[int], lens: np.ndarray) -> list[list[int]]:
        """Runs of contiguous slots; rows one by one where a batched call is not allowed."""
        groups = []
        for rows in fitting_runs(slots, cache.lengths, lens, cache.max_seq):
            batched_ok = cache.lengths[[slots[r] for r in rows]].max() == 0 or len(rows) <= self._prefill_with_past_batch
            groups.extend([rows] if batched_ok else [[r] for r in rows])
        return groups

    def _bind(self, cache: KVCache, kind: str, start: int, n: int, width: int) -> _Binding:
        io = self.sessions[kind].io_binding()
        b = _Binding(io, np.zeros((n, width), np.int64), np.zeros(n, np.int64), np.ones(n, np.int64),
                     np.empty((n, self.vocab_size), np.float32), np.empty(n, np.int64))
        if self._mrope:
            b.offsets = np.zeros((3, n, width), np.int64)
            io.bind_input("rope_offsets", "cpu", 0, b.offsets.dtype, b.offsets.shape, b.offsets.ctypes.data)
        for name, arr in (("input_ids", b.ids), ("past_lengths", b.past), ("seq_lengths", b.seq)):
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        for name, arr in (("logits", b.logits), ("next_token", b.next_token)):
            io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        if self.hidden_rows is not None:
            b.hidden = np.empty((n, self.hidden_width), self.np_dtype)
            io.bind_output("hidden_state", "cpu", 0, b.hidden.dtype, b.hidden.shape, b.hidden.ctypes.data)
            if any(t.name == "prompt_hidden" for t in self.manifest.graphs[kind].outputs):
                b.prompt = np.empty((n, width, self.hidden_width), self.np_dtype)
                io.bind_output("prompt_hidden", "cpu", 0, b.prompt.dtype, b.prompt.shape, b.prompt.ctypes.data)
        bind_cache(io, cache, start, n, self.lora_weights)
        return b


def portable_prefill(folder: Path, manifest: Manifest) -> tuple[Any, Path]:
    """(GraphRecord, path) of the artifact's portable prefill graph: a portable artifact's prefill.onnx, or the
    per-phase graph an ort export wrote beside its own (``--openvino-prefill``); DecodertError where there is none."""
    if target_info(manifest.target).standard_ops:
        graph = manifest.graphs["prefill"]
    elif "prefill.portable" in (manifest.phase_graphs or {}):
        graph = manifest.phase_graphs["prefill.portable"].graph
    else:
        raise DecodertError(f"{folder} has no portable prefill graph for OpenVINO (--target {manifest.target}); "
                            "export it with --openvino-prefill (ort target) or --target portable")
    path = folder / graph.file
    check_external_data(path)
    return graph, path


def _without_ort(phases: dict[str, str]) -> bool:
    """Do these phases run without the ort sessions: the prefill on OpenVINO's own runtime, the decode (and the
    verify passes) on native-cpu?"""
    return phases.get("prefill") in OPENVINO_RUNTIME and phases.get("decode") == "native-cpu"


def _chosen_finite(logits: np.ndarray, chosen: np.ndarray) -> bool:
    """Are the scores ``logits`` [..., V] at the graph's ArgMax ``chosen`` [...] all finite (O(n), the usual case)?"""
    return bool(np.isfinite(np.take_along_axis(logits, chosen[..., None], axis=-1)).all())


def _gather(out: StepOutput, rows: list[int], b: _Binding, want_logits: bool) -> None:
    out.next_token[rows] = b.next_token
    if want_logits and out.logits is not None:
        out.logits[rows] = b.logits
    elif not _chosen_finite(b.logits, b.next_token):
        # the graph's ArgMax over NaN / inf scores (a damaged model; ORT picks a leading NaN): these rows' logits
        # go with the step, so greedy decoding chooses as the sampler does, or fails as it does (generate.choose_tokens)
        if out.logits is None:
            out.logits = np.zeros((len(out.next_token), b.logits.shape[-1]), np.float32)
        out.logits[rows] = b.logits


def _run_bound(session: ort.InferenceSession, io: Any, folder: Path, kind: str) -> None:
    try:
        session.run_with_iobinding(io)
    except Exception as e:  # onnxruntime Fail/RuntimeError: a graph that loads but cannot run (damaged)
        text = first_line(e)[:300]
        raise DecodertError(f"{folder}: ONNX Runtime failed running the {kind} graph ({text}); the artifact may be "
                            "damaged (load it with verify='full' / --full-verify)") from None
