"""`KVCache`: the per-slot K/V state every backend allocates, on the host or on the GPU.

One class for the ort (CPU or CUDA execution provider) and trt backends: ``2 * layers`` buffers
``[slots, H_kv, max_seq, D]`` in the order k0, v0, k1, v1, ..., slots the outer (contiguous)
dimension, and ``lengths[slot]`` = tokens cached = the next write index. A backend binds
``pointer(i, slot)`` into its graphs or engines; runtime/backends/kv_blocks.py copies position ranges
in and out through ``geometry()`` (device) or ``buffers`` (host).

The rule: **row ``slot`` holds K/V for exactly the ids ``held(slot)``**: positions 0 .. n-1
(n = ``lengths[slot]``) were written by the model for those ids, in that order. This object is the
only writer of that record, through four verbs: ``commit`` (a backend, or the prefix cache, wrote K/V
for new ids), ``rewind`` (drop positions from the end: rejected drafts, a session turn that diverges),
``reset``, and ``move`` (a backend copied a row to another slot). K/V depend on the LoRA adapter the
row ran under too: ``use_adapter`` sets it (the graphs read ``adapters`` as each row's ``lora_index``) and
empties a row that holds K/V (and states) of another adapter, so no row ever mixes them. ``lengths``
is a read-only view: nothing else can change what a row says it holds, so the prefix cache, sessions
and speculation read the ids from here instead of assuming them (docs/features/cache-state.md).

Hybrid models (models/spec.py ``LAYER_KINDS``): only attention layers keep K/V (``kv_layers``: their
model layer numbers); a conv / linear-attention / Mamba2 layer keeps states ``states[j]``
[slots, *shape] (``state_names[j]`` = "conv.3", the graphs' ``past_conv.3`` / ``present_conv.3``),
bound in place like K/V. Such a state summarises every position the row holds, so it cannot be
rewound by setting a length. The rule for a row with states: ``rewind(slot, to)`` is allowed only
to what the row can return to exactly (``rewind_point``): ``to`` = its length (nothing to do), 0
(the states are zeroed), or the position of the row's ``snapshot`` (the states are restored); any
other ``to`` raises. Callers that want "as far back as needed" ask ``rewind_point(slot, to)`` and
run the ids between that point and ``to`` again (generate.prefill, speculation's replay).
A row's states change in two ways only: a backend's graph runs the ids it commits over them (in
place), or the caller gives the states the model computed for exactly the ids the row will hold:
``rewind(slot, to, states)`` (a verify pass's per-position states) and ``commit(slots, ids, states)``
(the prefix cache: K/V blocks copied in, and the states a row had when it held exactly those ids,
``read_states``). So whatever a row holds, its states are the model's after ``held(slot)``.

A graph updates states in place before anything records the ids it ran, so a run and its commit are
one step that an exception or Ctrl-C can split (between the chunks of a long prefill, or between a
graph run and its commit). The rule that keeps the record true: **a backend runs a graph over rows
with states only inside ``writing(slots)``, and commits the ids it ran inside it** (one run, one
commit: a chunked prefill commits every chunk). From the start of the block until its commit a row
is in flight; a row still in flight when the block ends (the commit never came) is taken back at
once to the furthest point whose states are known: its snapshot (states restored) or 0 (zeroed).
So an interrupted prefill, decode or verify leaves every row as its record says, the next turn of a
session or request on the row computes from the right states, and the prefix cache (which stores
``read_states`` beside ``held``) never stores states a run left ahead of its ids. Rows with K/V alone
need no block (K/V beyond ``lengths`` is never read): ``writing`` does nothing for them. Switching
a row's adapter (``use_adapter``) empties it like ``reset``: lengths, states and snapshot.

Encoder-decoder models (Whisper): ``cross`` (io name, per-slot shape) are per-row read-only inputs, the
cross-attention K/V of the clip window a row decodes, written once per window by the encoder graph and bound
into every decode step beside the K/V. The rule: **a row's K/V were computed over the cross K/V it holds
now**. ``use_cross(slot, tag)`` names the window (its digest) a row will decode; a row holding K/V of another
window is emptied first (``reset``) and the caller writes the new cross K/V (``use_cross`` returns True when
they must be written). ``reset`` keeps the cross K/V and their tag (they depend on the clip, not on the
ids); ``move`` carries the tag with the row (the backend copies the buffers).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.backends import kv_blocks


class KVCache:
    """K/V buffers of ``slots`` rows for one backend; ``device`` "cpu" (numpy arrays) or "cuda" (DeviceBuffer).

    ``dtype``: the numpy element type (needed on the host); on the GPU a dtype numpy lacks (bf16)
    is given as ``itemsize`` alone. Device buffers start zeroed, as host ones do.
    """

    def __init__(self, slots: int, max_seq: int, layers: int, kv_heads: int, head_dim: int,
                 dtype: Any = None, device: str = "cpu", itemsize: int | None = None,
                 kv_layers: Sequence[int] | None = None, states: Sequence[tuple] = (),
                 head_dims: Sequence[int] | None = None, cross: Sequence[tuple] = ()) -> None:
        """``layers``: K/V pairs (``kv_layers``: the model layer of each, default 0..layers-1); ``head_dims``:
        each pair's last dimension where they differ (Gemma 4's full layers; default ``head_dim`` for all);
        ``states``: (io name, per-slot shape[, numpy dtype: None = the cache's]) of every other per-layer
        state (hybrid models; a recurrent state is float32 in an fp16 model)."""
        self.slots, self.max_seq, self.device = slots, max_seq, device
        self.kv_layers = tuple(kv_layers) if kv_layers is not None else tuple(range(layers))
        if len(self.kv_layers) != layers:
            raise ValueError(f"{layers} K/V layers but kv_layers {list(self.kv_layers)}")
        self.dtype = np.dtype(dtype) if dtype is not None else None
        itemsize = itemsize if itemsize is not None else self.dtype.itemsize
        dims = list(head_dims) if head_dims is not None else [head_dim] * layers
        if len(dims) != layers:
            raise ValueError(f"{layers} K/V layers but head_dims {dims}")
        self.kv_heads = kv_heads
        # per buffer (k0, v0, k1, ...): the slot shape, one position of one head, one slot
        self.slot_shapes = [(kv_heads, max_seq, d) for d in dims for _ in range(2)]
        self.pos_bytes_of = [d * itemsize for d in dims for _ in range(2)]
        self.slot_bytes_of = [kv_heads * max_seq * b for b in self.pos_bytes_of]
        self.uniform = len(set(dims)) <= 1
        self.slot_shape = self.slot_shapes[0] if self.slot_shapes else (kv_heads, max_seq, head_dim)  # uniform caches
        self.pos_bytes = head_dim * itemsize if self.uniform else 0
        self.slot_bytes = kv_heads * max_seq * self.pos_bytes  # one slot of one buffer (uniform caches)
        if device == "cpu":
            self.buffers: list[Any] = [np.zeros((slots, *shape), self.dtype) for shape in self.slot_shapes]
        else:
            from decodert.plugins.cuda_mem import DeviceBuffer

            self.buffers = [DeviceBuffer(slots * n) for n in self.slot_bytes_of]
        self.state_names = [st[0] for st in states]
        self.state_shapes = [tuple(st[1]) for st in states]  # per slot
        self.state_dtypes = [np.dtype(st[2]) if len(st) > 2 and st[2] is not None else self.dtype for st in states]
        self.state_bytes = [int(np.prod(shape)) * (t.itemsize if t is not None else itemsize)  # one slot of each
                            for shape, t in zip(self.state_shapes, self.state_dtypes)]
        if device == "cpu":
            self.states: list[Any] = [np.zeros((slots, *shape), t) for shape, t in zip(self.state_shapes,
                                                                                      self.state_dtypes)]
        else:
            self.states = [DeviceBuffer(slots * n) for n in self.state_bytes]
        self._snapshots: dict[int, tuple[int, list[bytes]]] = {}  # slot -> (position, each state's bytes)
        self._in_flight: set[int] = set()  # rows a graph may have updated whose ids are not committed yet (``writing``)
        self._lengths = np.zeros(slots, np.int64)  # [slots] tokens cached = the next write index
        self.lengths = self._lengths.view()  # read-only: only the verbs below change it
        self.lengths.flags.writeable = False
        self._held = np.zeros((slots, max_seq), np.int64)  # [slots, max_seq] the ids whose K/V each row holds
        self._adapter = np.zeros(slots, np.int64)  # [slots] LoRA slot each row runs under (the graphs' lora_index; 0 none)
        self.adapters = self._adapter.view()  # read-only: backends bind it
        self.adapters.flags.writeable = False
        self._adapter_tag = np.zeros(slots, np.int64)  # [slots] which loaded adapter that is (unique per load; 0 none)
        # encoder-decoder: per-row cross K/V (io name, per-slot shape), host buffers [slots, *shape]
        self.cross_names = [c[0] for c in cross]
        self.cross: list[np.ndarray] = [np.zeros((slots, *c[1]), self.dtype) for c in cross]
        self._cross_tag: list[bytes | None] = [None] * slots  # the window each row's cross K/V are of

    def pointer(self, i: int, slot: int) -> int:
        """Address of slot ``slot`` in buffer ``i``."""
        buf = self.buffers[i]
        base = buf.ctypes.data if self.device == "cpu" else buf.ptr
        return base + slot * self.slot_bytes_of[i]

    def state_pointer(self, j: int, slot: int) -> int:
        """Address of slot ``slot`` in state ``j``."""
        buf = self.states[j]
        return (buf.ctypes.data if self.device == "cpu" else buf.ptr) + slot * self.state_bytes[j]

    @property
    def has_state(self) -> bool:
        """Whether rows keep states beyond K/V (a hybrid model): then rewind follows ``rewind_point``."""
        return bool(self.states)

    def geometry(self) -> kv_blocks.DeviceGeometry:
        """Where each slot and position of the device buffers is (runtime/backends/kv_blocks.py)."""
        if not self.uniform:
            raise DecodertError("the device prefix cache needs one head_dim for every K/V layer")
        return kv_blocks.DeviceGeometry([b.ptr for b in self.buffers], self.slot_bytes, self.pos_bytes,
                                        self.kv_heads, self.max_seq)

    # -- what a row holds: the only writers ---------------------------------------------------
    def held(self, slot: int) -> np.ndarray:
        """The ids whose K/V row ``slot`` holds, in position order (a copy) [lengths[slot]]."""
        return self._held[slot, : self._lengths[slot]].copy()

    def check_room(self, slots: Sequence[int], counts: Sequence[int] | np.ndarray, what: str = "the tokens") -> None:
        """DecodertError unless every row has room for its ``counts[j]`` new positions."""
        past = self._lengths[list(slots)]
        if (past + np.asarray(counts, np.int64) > self.max_seq).any():
            raise DecodertError(f"{what} do not fit: the KV cache is full ({self.max_seq} tokens per row; "
                                "export with a larger --max-seq)")

    def commit(self, slots: Sequence[int], ids: Sequence[np.ndarray] | np.ndarray,
               states: Sequence[Sequence[bytes]] | None = None) -> None:
        """The backend has just written K/V for ``ids[j]`` at ``lengths[slots[j]]`` onwards: record them.

        A row with states: the backend's graph updated them over those ids, or ``states[j]`` gives every
        state of row ``slots[j]`` as the model computed it after all the ids the row then holds (each
        state's bytes, as ``read_states`` returns them: the prefix cache, which copied K/V in)."""
        rows = [np.asarray(r, np.int64).reshape(-1) for r in ids]
        if len(rows) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"commit: {len(rows)} rows for slots {list(slots)}")
        if states is not None and (len(states) != len(slots)
                                   or any([len(b) for b in st] != self.state_bytes for st in states)):
            raise ValueError(f"commit: states for slots {list(slots)} are not {len(slots)} x {self.state_bytes} bytes")
        self.check_room(slots, [len(r) for r in rows])
        for j, (slot, row) in enumerate(zip(slots, rows)):
            self._in_flight.discard(slot)
            start = self._lengths[slot]
            self._held[slot, start : start + len(row)] = row
            self._lengths[slot] = start + len(row)
            if states is not None:
                self._write_states(slot, list(states[j]))

    @contextmanager
    def writing(self, slots: Sequence[int], wait: Callable[[], None] | None = None) -> Iterator[None]:
        """The block in which a backend runs a graph that updates the states of rows ``slots`` in place
        and commits the ids it ran (see the module docstring). A row not committed when the block ends
        (an exception, KeyboardInterrupt) goes back to its snapshot or to 0, so its states match its ids.
        ``wait``: called first when a row goes back (the trt backend's stream sync: its graph may still
        be writing). Nothing to do for K/V alone."""
        if not self.states:
            yield
            return
        rows = [int(s) for s in slots]
        self._in_flight.update(rows)
        try:
            yield
        finally:
            left = [s for s in rows if s in self._in_flight]
            if left:
                try:
                    if wait is not None:
                        wait()
                finally:
                    for slot in left:
                        self._take_back(slot)

    def _take_back(self, slot: int) -> None:
        """Row ``slot``'s states are not those of its ids: back to its snapshot (restored) or to 0."""
        self._in_flight.discard(slot)
        snap = self._snapshots.get(slot)
        if snap is None or snap[0] > self._lengths[slot]:
            self.reset(slot)
            return
        self._write_states(slot, snap[1])
        self._lengths[slot] = snap[0]

    def use_adapter(self, slot: int, index: int, tag: int) -> None:
        """Row ``slot``'s next K/V are computed under the adapter loaded as ``tag`` into LoRA slot ``index``
        (0, 0: none). A row holding K/V of another adapter is emptied first (``reset``: its states zeroed,
        its snapshot dropped, both computed under the other adapter): K/V and states never mix adapters."""
        if self._adapter_tag[slot] != tag:
            self.reset(slot)
        self._adapter[slot], self._adapter_tag[slot] = index, tag

    def use_cross(self, slot: int, tag: bytes) -> bool:
        """Row ``slot`` decodes over the cross K/V of window ``tag`` from now on; True: the caller writes them into
        ``cross[j][slot]`` now (another window's were there: the row, whose K/V were computed over those, is
        emptied first)."""
        if self._cross_tag[slot] == tag:
            return False
        self.reset(slot)
        self._cross_tag[slot] = tag
        return True

    def cross_tag(self, slot: int) -> bytes | None:
        """The window whose cross K/V row ``slot`` holds (None: none written)."""
        return self._cross_tag[slot]

    def adapter_tag(self, slot: int) -> int:
        """The adapter (its load tag; 0: none) the K/V of row ``slot`` were computed under."""
        return int(self._adapter_tag[slot])

    def rewind(self, slot: int, to: int, states: Mapping[str, np.ndarray] | None = None) -> None:
        """Keep only the first ``to`` positions of ``slot`` (later K/V stays, unread, until overwritten).

        A row with states goes back only to ``rewind_point(slot, to) == to``: its length, 0 (states
        zeroed) or its snapshot (states restored); another ``to`` raises DecodertError. Or the caller
        gives ``states``: every state of the row as it is after ``to`` tokens, computed by the model
        (a verify pass's per-position states: speculation), written as the row's states."""
        n = int(self._lengths[slot])
        if not 0 <= to <= n:
            raise ValueError(f"rewind slot {slot} to {to}: it holds {n} tokens")
        if states is not None:
            if sorted(states) != sorted(self.state_names):
                raise ValueError(f"rewind slot {slot}: states {sorted(states)} are not the row's {self.state_names}")
            self._write_states(slot, [np.ascontiguousarray(states[name], self.state_dtypes[j]).tobytes()
                                      for j, name in enumerate(self.state_names)])
        elif self.states and to not in (n, 0):
            snap = self._snapshots.get(slot)
            if snap is None or snap[0] != to:
                raise DecodertError(f"slot {slot}: a recurrent/conv state cannot be rewound from {n} to {to} tokens "
                                    f"(its snapshot is at {snap[0] if snap else 'none'}); rewind to rewind_point()")
            self._write_states(slot, snap[1])
        elif self.states and to == 0 < n:
            self.reset(slot)
            return
        self._lengths[slot] = to
        if slot in self._snapshots and self._snapshots[slot][0] > to:
            del self._snapshots[slot]

    def rewind_point(self, slot: int, to: int) -> int:
        """The furthest position <= ``to`` that ``rewind`` can take ``slot`` back to exactly: ``to``
        itself for K/V alone; with states, the row's length, its snapshot or 0."""
        n = int(self._lengths[slot])
        if not self.states or to >= n:
            return min(to, n)
        snap = self._snapshots.get(slot)
        return snap[0] if snap is not None and snap[0] <= to else 0

    def snapshot(self, slot: int) -> None:
        """Keep a copy of ``slot``'s states at its current length (one per row; the last one taken),
        so ``rewind`` can return there (speculation: before a verify pass). No-op without states."""
        if self.states:
            self._snapshots[slot] = (int(self._lengths[slot]), self._read_states(slot))

    def read_states(self, slot: int) -> list[bytes]:
        """A copy of every state of ``slot`` (their bytes, in ``state_names`` order): the model's states
        after ``held(slot)``. Empty without states."""
        return self._read_states(slot) if self.states else []

    def read_snapshot(self, slot: int) -> tuple[int, list[bytes]] | None:
        """A copy of ``slot``'s snapshot: (its position, every state's bytes there), or None (none kept, or
        K/V alone). With ``commit(..., states)`` and ``snapshot`` a saved row is rebuilt exactly (a saved session)."""
        snap = self._snapshots.get(slot)
        return None if snap is None else (snap[0], list(snap[1]))

    def reset(self, slot: int | None = None) -> None:
        """Forget the cached tokens of one slot (or all); buffers are kept, not freed; states are zeroed."""
        self._lengths[slice(None) if slot is None else slot] = 0
        for s in range(self.slots) if slot is None else (slot,):
            self._snapshots.pop(s, None)
            self._in_flight.discard(s)
            if self.states:
                self._write_states(s, [bytes(n) for n in self.state_bytes])

    def _read_states(self, slot: int) -> list[bytes]:
        if self.device == "cpu":
            return [buf[slot].tobytes() for buf in self.states]
        from decodert.plugins.cuda_mem import PinnedArray, Stream, copy_async

        stream, hosts = Stream(), [PinnedArray((n,), np.uint8) for n in self.state_bytes]
        for j, host in enumerate(hosts):
            copy_async(host.ptr, self.state_pointer(j, slot), self.state_bytes[j], stream, "d2h")
        stream.sync()
        out = [host.array.tobytes() for host in hosts]
        for host in hosts:
            host.free()
        stream.destroy()
        return out

    def _write_states(self, slot: int, data: list[bytes]) -> None:
        if self.device == "cpu":
            for buf, raw in zip(self.states, data):
                buf[slot] = np.frombuffer(raw, buf.dtype).reshape(buf.shape[1:])
            return
        from decodert.plugins.cuda_mem import PinnedArray, Stream, copy_async

        stream, hosts = Stream(), [PinnedArray((len(raw),), np.uint8) for raw in data]
        for j, (host, raw) in enumerate(zip(hosts, data)):
            host.array[:] = np.frombuffer(raw, np.uint8)
            copy_async(self.state_pointer(j, slot), host.ptr, len(raw), stream, "h2d")
        stream.sync()
        for host in hosts:
            host.free()
        stream.destroy()

    def move(self, src: int, dst: int) -> None:
        """The backend has copied row ``src``'s positions into ``dst``: ``dst`` holds what ``src`` held, ``src`` nothing."""
        if src == dst:
            return
        n = self._lengths[src]
        self._held[dst, :n] = self._held[src, :n]
        self._lengths[dst], self._lengths[src] = n, 0
        self._snapshots.pop(dst, None)
        self._in_flight.discard(src)
        self._in_flight.discard(dst)
        if src in self._snapshots:
            self._snapshots[dst] = self._snapshots.pop(src)
        if self.states:  # src starts again from zero states (dst's were copied by the backend)
            self._write_states(src, [bytes(n) for n in self.state_bytes])
        self._adapter[dst], self._adapter_tag[dst] = self._adapter[src], self._adapter_tag[src]
        if self.cross:
            self._cross_tag[dst], self._cross_tag[src] = self._cross_tag[src], None

    def free(self) -> None:
        """Release the buffers now (device memory is freed; host arrays lose their reference)."""
        if self.device != "cpu":
            for buf in self.buffers + self.states:
                buf.free()
        self.buffers, self.states = [], []


def contiguous_runs(slots: Sequence[int]) -> list[list[int]]:
    """Indices into ``slots`` grouped into runs of consecutive slot numbers, in slot order (one bound
    call each: a run's first index has its lowest slot)."""
    runs: list[list[int]] = []
    for j in sorted(range(len(slots)), key=lambda j: slots[j]):
        if runs and slots[runs[-1][-1]] + 1 == slots[j]:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def fitting_runs(slots: Sequence[int], lengths: np.ndarray, counts: Sequence[int] | np.ndarray, max_seq: int) -> list[list[int]]:
    """``contiguous_runs``, split so that each run's padded call stays inside the cache.

    A run is one call of width max(counts) over rows right-padded to it, and a call writes K/V (and
    takes RoPE positions) at past .. past + width - 1 of every row; a row with less room than that
    (a short row near the end of its context beside a longer one) runs alone, at its own width."""
    out: list[list[int]] = []
    for run in contiguous_runs(slots):
        width = max(counts[j] for j in run)
        if all(lengths[slots[j]] + width <= max_seq for j in run):
            out.append(run)
        else:
            out.extend([j] for j in run)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the longest common prefix of id arrays ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), max(limit, 0))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
