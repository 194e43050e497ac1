"""A block prefix cache: the K/V of prompt prefixes seen before, reused instead of prefilled again.

Prompts are cut into blocks of ``block_tokens`` ids. Block k is keyed by a hash chain,
``key_k = blake2b(key_{k-1} + ids of block k)``, so one key names a whole prefix; each entry also
keeps its ids and they are compared on lookup, so a hash collision can never return wrong K/V.
An entry holds a copy of that block's K/V made by the backend (``backend.read_kv``): host arrays
for ONNX Runtime on the CPU, device memory for TensorRT (runtime/backends/kv_blocks.py). What is stored is
what the row holds, ids and K/V together, as the cache records them (``KVCache.held``): the caller
never says which ids a row's K/V belongs to, so it cannot say it wrongly.

K/V depend on the LoRA adapter a row ran under as well: a chain starts from that adapter's key
(``KVCache.adapter_tag``; none: the empty key), so a prompt never loads K/V of another adapter.

Only whole blocks are cached; the partial block at the end of a prompt is always prefilled.
Because K/V at position p depends only on ids 0..p (causal attention, absolute positions; a
sliding window only limits what a query reads), a hit is the same K/V the prefill would write.

Hybrid models (a cache with conv / recurrent states, ``KVCache.has_state``): a linear layer resumes
only from its state at a boundary, never from K/V. Such a state exists only where a call ended,
so the prefill of a hybrid row stops at the block boundaries ``stops`` chooses (generate.prefill):
the prompt's last whole block boundary, every ``state_every`` tokens (the ort backend's 512-token
chunks), the end of a cached K/V chain that has no state yet, and where prompts admitted together
share blocks (``split_shared``). There the entry of the block ending at that boundary keeps the
row's states (``KVCache.read_states``: the states the model computed after exactly the chain's ids),
counted in the budget. A load goes only as deep as the deepest entry with a state and writes K/V
and states through ``KVCache.commit(..., states)``; entries without a state below it serve only as
its ancestors. So a hybrid prompt reuses whole blocks up to a boundary where some earlier prompt
(or the same one) stopped, not any common prefix: a prompt that shares 100 tokens with a cached one
that did not stop at 96 reuses only up to a lower boundary that has states (or nothing) the first
time, and stops at 96 itself, so the next such prompt loads 96 tokens.

Eviction is LRU under a byte budget. Lookups and stores touch a chain from its last block back
to its first, so a block is never older than its descendants: the LRU entry is always a leaf,
and eviction never leaves a block that no lookup can reach.

A disk tier (runtime/persist/disk_tier.py, ``disk``) keeps blocks across processes: every block a store
adds (and a hybrid entry that gains its states) is handed to it, written in the background; a lookup that
ends in memory before its limit asks it for the next blocks of the chain, synchronously, and the blocks it
gives become memory entries first (under this budget, as if stored), so what a row is loaded with always
comes from an entry here, through ``write_kv`` and ``KVCache.commit`` as any hit. Its files are keyed by
the chain from the empty key (``_Entry.dkey``) in a folder of the artifact's identity and the adapter's
stable key (``adapter_key``: a load tag -> that key, None: not kept on disk).

How a loop uses it, per admitted request (the scheduler here, and a server's engine loop):

    cached = prefix.load(cache, slot, prompt)           # K/V copied into the slot, committed there
    backend.prefill(cache, [slot], [prompt[cached:]])   # only the rest
    prefix.store(cache, slot)                           # new whole blocks of what the row holds
    ...                                                  # when the request ends, before the slot
    prefix.store(cache, slot)                           # is reused: its generated blocks too

Not thread-safe: the one thread that runs the loop (holding the LLM's lock) uses it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from decodert.errors import DecodertError

DEFAULT_BLOCK_TOKENS = 32
DEFAULT_STATE_EVERY = 512


@dataclass(eq=False)
class _Entry:
    key: bytes  # hash chain up to and including this block
    parent: "_Entry | None"
    ids: np.ndarray  # [block_tokens] int64, compared on lookup
    kv: Any  # the backend's block (host array or device block)
    nbytes: int  # of kv and state
    children: int = 0
    state: list[bytes] | None = None  # hybrid models: every state of a row after the chain's ids (host bytes)
    dkey: bytes = b""  # the chain from the empty key: the disk tier's name of the block, whatever the adapter


@dataclass
class PrefixStats:
    """Counters since the cache was made; ``bytes`` is what the entries hold now."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    hit_tokens: int = 0  # prompt tokens loaded from the cache instead of prefilled
    stored_blocks: int = 0
    stored_states: int = 0  # hybrid models: states kept at a block boundary
    evicted_blocks: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    blocks: int = 0
    disk_hits: int = 0  # lookups that loaded at least one block from the disk tier
    disk_hit_tokens: int = 0  # prompt tokens of those blocks
    disk_read_bytes: int = 0
    disk_written_blocks: int = 0
    disk_written_bytes: int = 0
    disk_dropped: int = 0  # blocks not written: the writer's queue was full (or the tier off)
    disk_evicted_blocks: int = 0
    disk_damaged: int = 0  # damaged, truncated or foreign files skipped and deleted
    disk_bytes: int = 0  # of the tier's files in its directory, as last counted


class PrefixCache:
    """Block prefix cache over one backend's K/V (see the module docstring).

    ``budget_bytes``: the most the entries may hold (never exceeded; a block that does not fit
    after evicting every block outside the chain being stored is not stored).
    """

    def __init__(self, backend: Any, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 state_every: int | None = None) -> None:
        """``state_every``: tokens between the states a hybrid prompt keeps on its way (rounded up to whole
        blocks; default the backend's ``prefill_chunk``, else 512). ``disk`` (a DiskTier, attach_disk) is off
        until attached."""
        if block_tokens < 1:
            raise DecodertError(f"prefix cache block size must be at least 1 token, not {block_tokens}")
        if budget_bytes < 0:
            raise DecodertError(f"prefix cache budget must be >= 0 bytes, not {budget_bytes}")
        self.backend = backend
        self.block_tokens = int(block_tokens)
        self.budget_bytes = int(budget_bytes)
        self.block_bytes = int(backend.kv_bytes(self.block_tokens))
        every = int(state_every or getattr(backend, "prefill_chunk", 0) or DEFAULT_STATE_EVERY)
        self.state_every = -(-max(every, 1) // self.block_tokens) * self.block_tokens
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first, most recent last
        self._wanted: set[bytes] = set()  # chain keys where a hybrid prompt should stop (split_shared)
        self._stateful = False  # has seen a cache with states: its entries are useful only below a state
        self.stats = PrefixStats()
        self.disk: Any = None  # runtime/persist/disk_tier.py DiskTier, or None
        self.adapter_key: Callable[[int], str | None] = lambda tag: "" if tag == 0 else None

    def attach_disk(self, make: Callable[[PrefixStats], Any]) -> None:
        """Put a disk tier under this cache: ``make(stats)`` -> a DiskTier updating these stats."""
        self.disk = make(self.stats)

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, ids: np.ndarray, limit: int | None = None, adapter: int = 0) -> list[_Entry]:
        """The longest chain of cached whole blocks that ``ids[:limit]`` starts with under ``adapter``
        (a load tag, 0: none), touched as used."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        limit = len(ids) if limit is None else min(int(limit), len(ids))
        chain: list[_Entry] = []
        key = _root(adapter)
        b = self.block_tokens
        for start in range(0, limit - b + 1, b):
            block = ids[start : start + b]
            key = _chain_key(key, block)
            entry = self._entries.get(key)
            if entry is None or not np.array_equal(entry.ids, block):
                break
            chain.append(entry)
        self._touch(chain)
        return chain

    def reach(self, ids: np.ndarray, has_state: bool = False, adapter: int = 0) -> int:
        """Tokens of ``ids`` a load could take from the cache now (touched as used): its cached whole blocks,
        for a row with states only up to the deepest entry that keeps them (warm start checks it)."""
        chain = self.match(ids, None, adapter)
        return (_deepest_state(chain) if has_state else len(chain)) * self.block_tokens

    def load(self, cache: Any, slot: int, ids: np.ndarray, limit: int | None = None) -> int:
        """Copy the longest cached prefix of ``ids`` into ``slot`` (committed there) -> the slot's cached length.

        At most ``limit`` tokens (default ``len(ids) - 1``: the last prompt token is always run, its
        logits choose the first new token). What the slot holds must be a prefix of ``ids`` (nothing,
        for a fresh slot; ``generate.prefill`` rewinds a row to that): blocks it holds are not copied
        again, and a hit shorter than what the slot holds changes nothing. A row with states loads
        only up to the deepest entry that keeps states, and takes them with the K/V.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        have = int(cache.lengths[slot])
        if not np.array_equal(cache.held(slot), ids[:have]):
            raise DecodertError(f"prefix cache: slot {slot} holds ids that do not begin {len(ids)} prompt ids")
        limit = len(ids) - 1 if limit is None else limit
        self.stats.lookups += 1
        chain = self.match(ids, limit, cache.adapter_tag(slot))
        if self.disk is not None and self.disk.enabled and len(chain) < limit // self.block_tokens:
            chain = self._from_disk(cache, chain, ids, limit, cache.adapter_tag(slot))
        if cache.has_state:  # a linear layer resumes only from its state at a boundary
            self._stateful = True
            chain = chain[: _deepest_state(chain)]
        if chain and self.disk is not None and (akey := self.adapter_key(cache.adapter_tag(slot))) is not None:
            self.disk.touch(akey, [e.dkey for e in chain], time.time_ns())  # its files stay as recent as its entries
        hit = len(chain) * self.block_tokens
        if hit <= have:
            return have
        b = self.block_tokens
        start = have // b * b  # the partial block the slot holds is copied again, whole
        if cache.has_state and start != have:
            start = 0  # a row with states goes back only to its length or 0 (all of it is in the chain)
        cache.rewind(slot, start)
        for k in range(start // b, len(chain)):
            self.backend.write_kv(cache, slot, k * b, chain[k].kv)
            if not cache.has_state:
                cache.commit([slot], [chain[k].ids])
        if cache.has_state:  # K/V of every block, and the states after the last one
            cache.commit([slot], [np.concatenate([e.ids for e in chain[start // b :]])], states=[chain[-1].state])
        self.stats.hits += 1
        self.stats.hit_tokens += hit - have
        return hit

    def _from_disk(self, cache: Any, chain: list[_Entry], ids: np.ndarray, limit: int, tag: int) -> list[_Entry]:
        """``chain`` continued with the blocks the disk tier has of ``ids[:limit]``, made memory entries (a row
        with states: only up to the deepest block with states, and only when all of that fits the budget)."""
        akey = self.adapter_key(tag)
        if akey is None:
            return chain
        b = self.block_tokens
        dkey = chain[-1].dkey if chain else b""
        want = []
        for k in range(len(chain), limit // b):
            block = ids[k * b : (k + 1) * b]
            dkey = _chain_key(dkey, block)
            want.append((dkey, block))
        states = list(cache.state_bytes) if cache.has_state else None
        found = self.disk.read_chain(akey, want, self.block_bytes, states)
        if cache.has_state:
            found = found[: next((k + 1 for k in range(len(found) - 1, -1, -1) if found[k].states is not None), 0)]
        need = sum(self.block_bytes + sum(len(x) for x in f.states or ()) for f in found)
        if not found or not self._make_room(chain, need):
            return chain
        key, before = chain[-1].key if chain else _root(tag), len(chain)
        for (dkey, block), got in zip(want, found):
            key = _chain_key(key, block)
            if key in self._entries:  # a 128-bit collision with other ids in memory: keep what is there
                break
            kv = self.backend.kv_from_bytes(cache, got.kv, b)
            nbytes = self.block_bytes + sum(len(x) for x in got.states or ())
            entry = _Entry(key, chain[-1] if chain else None, block.copy(), kv, nbytes, state=got.states, dkey=dkey)
            if entry.parent is not None:
                entry.parent.children += 1
            self._entries[key] = entry
            self._grow(nbytes)
            chain.append(entry)
            self.stats.disk_hit_tokens += b
            self.stats.disk_read_bytes += got.nbytes
        self.stats.disk_hits += len(chain) > before
        self._touch(chain)
        return chain

    def stops(self, cache: Any, slot: int, ids: np.ndarray) -> list[int]:
        """Where a row with states should end a prefill call so its states are stored there (ascending,
        past what it holds; none for K/V alone, or when a block and a state do not fit the budget):
        the prompt's last whole block boundary before its last token, every ``state_every`` tokens, the
        end of the cached K/V chain it matches when that has no state yet, and boundaries
        ``split_shared`` asked for."""
        if not cache.has_state:
            return []
        self._stateful = True
        if self.block_bytes + sum(cache.state_bytes) > self.budget_bytes:
            return []
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        b, have = self.block_tokens, int(cache.lengths[slot])
        last = (len(ids) - 1) // b * b
        points = set(range(self.state_every, last + 1, self.state_every)) | {last}
        key, known, stored = _root(cache.adapter_tag(slot)), 0, set()  # the prompt's chain: the K/V chain it matches
        for k in range(last // b):
            key = _chain_key(key, ids[k * b : (k + 1) * b])
            entry = self._entries.get(key)
            if key in self._wanted:
                points.add((k + 1) * b)
            if known == k and entry is not None and np.array_equal(entry.ids, ids[k * b : (k + 1) * b]):
                known = k + 1
                if entry.state is not None:
                    stored.add(known * b)
        points.add(known * b)  # K/V cached without a state at its end: take it there for the next prompt
        return sorted(p for p in points - stored if p > have)

    def split_shared(self, prompts: list[np.ndarray], states: bool = False) -> tuple[list[int], list[int]]:
        """(leaders, followers): a follower's first block is an earlier prompt's and is not cached
        yet, so it can load it once the leaders are prefilled and stored. For a model with states
        (``states``), a follower's shared boundary with its leader must have no state yet, and the
        leader stops there (``stops``)."""
        self._stateful = self._stateful or states
        b = self.block_tokens
        firsts: dict[bytes, int] = {}
        leaders, followers = [], []
        for j, ids in enumerate(prompts):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            key = _chain_key(b"", ids[:b]) if len(ids) > b else None
            lead = firsts.get(key) if key is not None else None
            if key is not None and lead is not None and self._worth_waiting(
                    np.asarray(prompts[lead], dtype=np.int64).reshape(-1), ids, key):
                followers.append(j)
            else:
                leaders.append(j)
                if key is not None:
                    firsts.setdefault(key, j)
        return leaders, followers

    def _worth_waiting(self, leader: np.ndarray, ids: np.ndarray, first: bytes) -> bool:
        if not self._stateful:
            return first not in self._entries
        b = self.block_tokens
        n = min(len(leader), len(ids)) - 1
        diff = np.flatnonzero(leader[:n] != ids[:n])
        shared = (int(diff[0]) if diff.size else n) // b * b
        key = b""
        for k in range(shared // b):
            key = _chain_key(key, ids[k * b : (k + 1) * b])
        entry = self._entries.get(key)
        if entry is not None and entry.state is not None:
            return False  # it loads there now
        if len(self._wanted) > 4096:
            self._wanted.clear()
        self._wanted.add(key)
        return True

    # -- stores ----------------------------------------------------------------------------------
    def store(self, cache: Any, slot: int) -> int:
        """Keep every whole block of what ``slot`` holds (``cache.held(slot)`` and its K/V) not cached
        yet. Returns the number of new blocks stored. A row with states is stored only when it holds
        whole blocks: its states go with the last one (without them its K/V resumes nothing)."""
        ids = cache.held(slot)
        if self.block_bytes > self.budget_bytes:
            return 0
        if cache.has_state:
            return self._store_with_state(cache, slot, ids)
        root = _root(cache.adapter_tag(slot))
        chain = self.match(ids, adapter=cache.adapter_tag(slot))
        key = chain[-1].key if chain else root
        b, added = self.block_tokens, 0
        for start in range(len(chain) * b, len(ids) - b + 1, b):
            if not self._make_room(chain, self.block_bytes):
                break
            entry = self._new_entry(cache, slot, chain, key, ids[start : start + b].copy(), start)
            if entry is None:
                break
            key = entry.key
            added += 1
        self._touch(chain)
        self.stats.stored_blocks += added
        self._write_behind(cache, slot, chain, added)
        return added

    def _store_with_state(self, cache: Any, slot: int, ids: np.ndarray) -> int:
        self._stateful = True
        b, n = self.block_tokens, len(ids)
        if n == 0 or n % b:
            return 0
        chain = self.match(ids, adapter=cache.adapter_tag(slot))
        if len(chain) * b == n and chain[-1].state is not None:
            return 0
        state = cache.read_states(slot)
        need = (n // b - len(chain)) * self.block_bytes + sum(len(x) for x in state)
        if not self._make_room(chain, need):
            return 0
        key = chain[-1].key if chain else _root(cache.adapter_tag(slot))
        added = 0
        for start in range(len(chain) * b, n, b):
            entry = self._new_entry(cache, slot, chain, key, ids[start : start + b].copy(), start)
            if entry is None:
                self._touch(chain)
                return added
            key, added = entry.key, added + 1
        last = chain[-1]
        last.state = state
        last.nbytes += sum(len(x) for x in state)
        self._grow(sum(len(x) for x in state))
        self._wanted.discard(last.key)
        self._touch(chain)
        self.stats.stored_blocks += added
        self.stats.stored_states += 1
        self._write_behind(cache, slot, chain, max(added, 1))  # the entry that gained the states, at least
        return added

    def _write_behind(self, cache: Any, slot: int, chain: list[_Entry], new: int) -> None:
        """Hand the last ``new`` entries of ``chain`` (just stored) to the disk tier, first to last, and touch the
        older ones; nothing without a tier, or for a row under an adapter with no stable key. A block the queue has
        no room for ends it (checked before a device block is copied to the host): the blocks after it would be
        unreachable without it."""
        disk = self.disk
        if disk is None or not disk.enabled or new <= 0:
            return
        akey = self.adapter_key(cache.adapter_tag(slot))
        if akey is None:
            return
        stamp, first = time.time_ns(), len(chain) - new
        for depth in range(first, len(chain)):
            e = chain[depth]
            if not disk.has_room(e.nbytes):
                self.stats.disk_dropped += len(chain) - depth
                break
            if not disk.put(akey, e.dkey, depth, e.ids, self.backend.kv_to_bytes(e.kv), e.state, stamp):
                self.stats.disk_dropped += len(chain) - depth - 1  # put counted this one
                break
        disk.touch(akey, [e.dkey for e in chain[:first]], stamp)

    def _new_entry(self, cache: Any, slot: int, chain: list[_Entry], key: bytes, block: np.ndarray,
                   start: int) -> _Entry | None:
        """A new entry for ``block`` (at ``start`` of the row) after ``chain``, appended to it; None on a
        128-bit hash collision with other ids (what is there is kept)."""
        parent_dkey = chain[-1].dkey if chain else b""
        key, parent_key = _chain_key(key, block), key
        if key in self._entries:
            return None
        dkey = key if parent_dkey == parent_key else _chain_key(parent_dkey, block)  # the same without an adapter
        kv = self.backend.read_kv(cache, slot, start, len(block))
        entry = _Entry(key, chain[-1] if chain else None, block, kv, self.block_bytes, dkey=dkey)
        if entry.parent is not None:
            entry.parent.children += 1
        self._entries[key] = entry
        self._grow(entry.nbytes)
        chain.append(entry)
        return entry

    def close(self) -> None:
        """Drop every entry and close the disk tier (its queued writes are written first)."""
        self.clear()
        if self.disk is not None:
            self.disk.close()

    def clear(self) -> None:
        """Drop every entry (device memory is freed now); the disk tier keeps its files."""
        for entry in self._entries.values():
            self.backend.free_kv(entry.kv)
        self._entries.clear()
        self._wanted.clear()
        self.stats.bytes = self.stats.blocks = 0

    @property
    def nbytes(self) -> int:
        return self.stats.bytes

    def __len__(self) -> int:
        return len(self._entries)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _touch(self, chain: list[_Entry]) -> None:
        for entry in reversed(chain):  # ancestors end up more recent than descendants
            self._entries.move_to_end(entry.key)

    def _grow(self, nbytes: int) -> None:
        self.stats.bytes += nbytes
        self.stats.blocks = len(self._entries)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)

    def _make_room(self, keep: list[_Entry], need: int) -> bool:
        """Evict LRU leaves (never one of ``keep``) until ``need`` more bytes fit; False if they cannot."""
        pinned = {id(e) for e in keep}
        if need > self.budget_bytes:
            return False
        while self.stats.bytes + need > self.budget_bytes:
            victim = next((e for e in self._entries.values() if e.children == 0 and id(e) not in pinned), None)
            if victim is None:
                return False
            self._evict(victim, pinned)
        return True

    def _evict(self, entry: _Entry, pinned: set[int]) -> None:
        """Drop a leaf; for a model with states also the ancestors it leaves as leaves without a state
        (K/V that no load can use)."""
        while True:
            del self._entries[entry.key]
            parent = entry.parent
            if parent is not None:
                parent.children -= 1
            self.backend.free_kv(entry.kv)
            self.stats.bytes -= entry.nbytes
            self.stats.blocks = len(self._entries)
            self.stats.evicted_blocks += 1
            if not (self._stateful and parent is not None and parent.children == 0 and parent.state is None
                    and id(parent) not in pinned):
                return
            entry = parent


def _deepest_state(chain: list[_Entry]) -> int:
    """How many entries of ``chain`` reach its deepest entry that keeps states (0: none)."""
    return next((k + 1 for k in range(len(chain) - 1, -1, -1) if chain[k].state is not None), 0)


def _root(adapter: int) -> bytes:
    """The key a chain starts from: empty without an adapter, else the adapter's load tag."""
    return b"" if adapter == 0 else b"lora" + int(adapter).to_bytes(8, "little")


def _chain_key(parent: bytes, block: np.ndarray) -> bytes:
    """Key of a block given its parent's key: blake2b over (parent key, the block's int64 ids)."""
    return hashlib.blake2b(parent + np.ascontiguousarray(block, dtype="<i8").tobytes(), digest_size=16).digest()


class LookupOnly:
    """A view of a PrefixCache that loads but never stores (sessions: their turns would fill it)."""

    def __init__(self, prefix: PrefixCache) -> None:
        self.prefix = prefix

    def load(self, cache: Any, slot: int, ids: np.ndarray, limit: int | None = None) -> int:
        return self.prefix.load(cache, slot, ids, limit)

    def store(self, cache: Any, slot: int) -> int:
        return 0

    def stops(self, cache: Any, slot: int, ids: np.ndarray) -> list[int]:
        return []  # a hybrid row runs its prompt in one call: nothing is stored
