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
Hybrid models (a cache with conv / recurrent states, ``KVCache.has_state``) are never stored or
loaded: their state exists only at the end of what a row ran, not at block boundaries.
Because K/V at position p depends only on ids 0..p (causal attention, absolute positions; a
sliding window only limits what a query reads), a hit is the same K/V the prefill would write.

Eviction is LRU under a byte budget. Lookups and stores touch a chain from its last block back
to its first, so a block is never older than its descendants: the LRU entry is always a leaf,
and eviction never leaves a block that no lookup can reach.

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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.errors import DecodertError

DEFAULT_BLOCK_TOKENS = 32


@dataclass(eq=False)
class _Entry:
    key: bytes  # hash chain up to and including this block
    parent: "_Entry | None"
    ids: np.ndarray  # [block_tokens] int64, compared on lookup
    kv: Any  # the backend's block (host array or device block)
    nbytes: int
    children: int = 0


@dataclass
class PrefixStats:
    """Counters since the cache was made; ``bytes`` is what the entries hold now."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    hit_tokens: int = 0  # prompt tokens loaded from the cache instead of prefilled
    stored_blocks: int = 0
    evicted_blocks: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    blocks: int = 0


class PrefixCache:
    """Block prefix cache over one backend's K/V (see the module docstring).

    ``budget_bytes``: the most the entries may hold (never exceeded; a block that does not fit
    after evicting every block outside the chain being stored is not stored).
    """

    def __init__(self, backend: Any, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise DecodertError(f"prefix cache block size must be at least 1 token, not {block_tokens}")
        if budget_bytes < 0:
            raise DecodertError(f"prefix cache budget must be >= 0 bytes, not {budget_bytes}")
        self.backend = backend
        self.block_tokens = int(block_tokens)
        self.budget_bytes = int(budget_bytes)
        self.block_bytes = int(backend.kv_bytes(self.block_tokens))
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first, most recent last
        self.stats = PrefixStats()

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

    def load(self, cache: Any, slot: int, ids: np.ndarray, limit: int | None = None) -> int:
        """Copy the longest cached prefix of ``ids`` into ``slot`` (committed there) -> the slot's cached length.

        At most ``limit`` tokens (default ``len(ids) - 1``: the last prompt token is always run, its
        logits choose the first new token). What the slot holds must be a prefix of ``ids`` (nothing,
        for a fresh slot; ``generate.prefill`` rewinds a row to that): blocks it holds are not copied
        again, and a hit shorter than what the slot holds changes nothing.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        have = int(cache.lengths[slot])
        if not np.array_equal(cache.held(slot), ids[:have]):
            raise DecodertError(f"prefix cache: slot {slot} holds ids that do not begin {len(ids)} prompt ids")
        if getattr(cache, "has_state", False):  # K/V blocks cannot restore a conv/recurrent state: no reuse
            return have
        limit = len(ids) - 1 if limit is None else limit
        self.stats.lookups += 1
        chain = self.match(ids, limit, cache.adapter_tag(slot))
        hit = len(chain) * self.block_tokens
        if hit <= have:
            return have
        b = self.block_tokens
        cache.rewind(slot, have // b * b)  # the partial block the slot holds is copied again, whole
        for k in range(have // b, len(chain)):
            self.backend.write_kv(cache, slot, k * b, chain[k].kv)
            cache.commit([slot], [chain[k].ids])
        self.stats.hits += 1
        self.stats.hit_tokens += hit - have
        return hit

    def split_shared(self, prompts: list[np.ndarray]) -> tuple[list[int], list[int]]:
        """(leaders, followers): a follower's first block is an earlier prompt's and is not cached
        yet, so it can load it once the leaders are prefilled and stored."""
        b, seen = self.block_tokens, set()
        leaders, followers = [], []
        for j, ids in enumerate(prompts):
            key = _chain_key(b"", np.asarray(ids)[:b]) if len(ids) > b else None
            if key is not None and key in seen and key not in self._entries:
                followers.append(j)
            else:
                leaders.append(j)
                seen.add(key)
        return leaders, followers

    # -- stores ----------------------------------------------------------------------------------
    def store(self, cache: Any, slot: int) -> int:
        """Keep every whole block of what ``slot`` holds (``cache.held(slot)`` and its K/V) not cached
        yet. Returns the number of new blocks stored."""
        ids = cache.held(slot)
        if self.block_bytes > self.budget_bytes or getattr(cache, "has_state", False):
            return 0
        root = _root(cache.adapter_tag(slot))
        chain = self.match(ids, adapter=cache.adapter_tag(slot))
        key = chain[-1].key if chain else root
        b, added = self.block_tokens, 0
        for start in range(len(chain) * b, len(ids) - b + 1, b):
            if not self._make_room(chain):
                break
            block = ids[start : start + b].copy()
            key = _chain_key(key, block)
            if key in self._entries:  # a 128-bit hash collision with other ids: keep what is there
                break
            kv = self.backend.read_kv(cache, slot, start, b)
            entry = _Entry(key, chain[-1] if chain else None, block, kv, self.block_bytes)
            if entry.parent is not None:
                entry.parent.children += 1
            self._entries[key] = entry
            self._grow(entry.nbytes)
            chain.append(entry)
            added += 1
        self._touch(chain)
        self.stats.stored_blocks += added
        return added

    def clear(self) -> None:
        """Drop every entry (device memory is freed now)."""
        for entry in self._entries.values():
            self.backend.free_kv(entry.kv)
        self._entries.clear()
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

    def _make_room(self, keep: list[_Entry]) -> bool:
        """Evict LRU leaves (never one of ``keep``) until one more block fits; False if it cannot."""
        pinned = {id(e) for e in keep}
        while self.stats.bytes + self.block_bytes > self.budget_bytes:
            victim = next((e for e in self._entries.values() if e.children == 0 and id(e) not in pinned), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        if entry.parent is not None:
            entry.parent.children -= 1
        self.backend.free_kv(entry.kv)
        self.stats.bytes -= entry.nbytes
        self.stats.blocks = len(self._entries)
        self.stats.evicted_blocks += 1


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
