"""The prefix cache's disk tier: whole blocks written behind the memory tier, read back on a miss, kept across processes.

runtime/prefix_cache.py owns the lookup rule (the hash chain, ids compared, hybrid states only at boundaries); this
is a store it consults, and whatever it gives is copied into a row through ``write_kv`` and ``KVCache.commit`` as a
memory hit is. What is kept, where and when:

- **A file is one block** (a record, runtime/persist/records.py, kind "prefix-block"): its ids [b] int64, its K/V as
  the backend's bytes (``backend.kv_to_bytes``: one layout for host and device blocks, so the ort and trt backends
  read each other's files), and for a hybrid model the row's states after the chain's ids when the memory entry
  keeps them. Vision models: image tokens are ids keyed by the pixels (runtime/vision/tokens.py), so images are in
  the chain already.
- **Where**: ``DIR/<identity>/<chain key>.blk``. identity = ``artifact_identity(manifest, adapter key)`` (24 hex);
  the chain key (32 hex) is the prefix cache's hash chain from the empty key, the adapter being in the directory
  (a row under an adapter with no stable key, ``adapter_key`` None, is never written). ``about.json`` beside the
  blocks names the artifact for ``decodert cache list``.
- **Written on store, not on eviction**: a process that ends (restarted, killed, out of memory) evicts nothing,
  so blocks written only when evicted would be missing exactly when a restart wants them. A block is written once,
  and again when a hybrid's state joins an entry already on disk.
- **Off the decode path**: ``put`` takes a block's bytes (a host block as it is, a view of the memory entry's
  array; a device block copied to the host on the loop thread, since it may be evicted before the writer reaches
  it) into a queue bounded by ``queue_bytes`` (default 256 MiB), and a background thread writes. A block that does
  not fit the queue is dropped (``disk_dropped``), with the rest of its store's chain, never waited for: decoding
  never blocks on the disk. Reads are synchronous, on a memory miss, and only for the blocks the prompt
  being admitted needs (``read_chain``, up to the lookup's limit): they are what its time to first token is made of.
- **LRU under a byte budget** over the whole directory (every identity): a file's mtime is its recency. A store
  stamps every block of its chain (new ones when written, older ones touched) with the store's time less the
  block's depth in microseconds, and a hit stamps its chain so: a block is never older than its descendants, and
  the oldest file is a leaf. Over the budget, the
  oldest files are deleted down to 90% of it (the directory is scanned then, so other processes' files count).
- **Damaged, truncated, foreign or wrong-version files** (``DamagedState``) are skipped with one warning line per
  file (logging.warning) and deleted, never loaded; a file of the right name whose ids differ (another prompt: a
  128-bit collision) is only a miss. Only the tier's own files are ever deleted: a ``<32 hex>.blk`` name (or its
  temp file, or ``about.json``) in a ``<24 hex>`` folder, and for a block the record magic at its start (or a file
  shorter than it); anything else in the directory is left as it is.
- **A full disk, a read-only or unusable directory**: one warning line, and the tier turns itself off
  (``enabled`` False): serving goes on from memory.
- **Two processes on one directory**: every write is atomic (temp file, fsync, rename) and every read validated,
  so a reader sees a whole block or a miss; a block deleted under a reader is a miss.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from decodert.errors import DamagedState, DecodertError, first_line
from decodert.runtime.persist.records import MAGIC, artifact_identity, read_record, write_record

log = logging.getLogger("decodert.prefix_disk")

KIND = "prefix-block"
ABOUT = "about.json"
DEFAULT_GB = 4.0  # --cache-dir-gb when not given
DEFAULT_QUEUE_BYTES = 256 << 20  # blocks waiting for the writer, at most (SmolLM2 fp32: a 2,048-token context is 94 MB)
_BLOCK = re.compile(r"^[0-9a-f]{32}\.blk$")
_TEMP = re.compile(r"^\.[0-9a-f]{32}\.blk\..+\.tmp$|^\.about\.json\..+\.tmp$|^\.probe\..+\.tmp$")
_IDENTITY = re.compile(r"^[0-9a-f]{24}$")
_STALE_TEMP_S = 600  # a temp file older than this was left by a writer that died


@dataclass
class DiskBlock:
    """A block read back: its K/V bytes and, for a hybrid entry, its states (else None)."""

    kv: np.ndarray  # [nbytes] uint8 (backend.kv_from_bytes makes the backend's block of it)
    states: list[bytes] | None
    nbytes: int  # K/V and states


class DiskTier:
    """Block files under ``root`` for one artifact (``manifest``), at most ``budget_bytes`` in the directory.

    ``stats``: the prefix cache's PrefixStats, whose disk_* counters this updates (the writer thread too)."""

    def __init__(self, root: str | Path, manifest: Any, budget_bytes: int, stats: Any,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, about: dict | None = None) -> None:
        if budget_bytes <= 0:
            raise DecodertError(f"disk tier budget must be > 0 bytes, not {budget_bytes}")
        self.root = Path(root).expanduser()
        self.manifest = manifest
        self.budget_bytes = int(budget_bytes)
        self.queue_bytes = int(queue_bytes)
        self.stats = stats
        self.about = dict(about or {})
        self._identities = {"": artifact_identity(manifest)}  # adapter key -> identity (raises without hashes)
        self.enabled = True
        self._warned: set[str] = set()
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, Any, int]] = deque()  # (what, payload, bytes held)
        self._pending = 0  # bytes held by the queue
        self._busy = False  # the writer holds an item
        self._closed = False
        self._bytes = 0  # of the tier's files in the directory, as last counted
        self._made: set[str] = set()  # identity folders known to exist (with about.json)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=self.root)
            os.close(fd)
            os.unlink(probe)
            self._bytes = self._scan()
        except OSError as e:
            self._off(f"cannot use {self.root} ({e.strerror or first_line(e)})")
        self.stats.disk_bytes = self._bytes
        self._thread = threading.Thread(target=self._run, name="decodert-prefix-disk", daemon=True)
        self._thread.start()

    # -- identity and names --------------------------------------------------------------------------
    def identity(self, adapter: str) -> str:
        if adapter not in self._identities:
            self._identities[adapter] = artifact_identity(self.manifest, adapter)
        return self._identities[adapter]

    def path(self, adapter: str, key: bytes) -> Path:
        return self.root / self.identity(adapter) / f"{key.hex()}.blk"

    # -- writes (loop thread: queue only) ----------------------------------------------------------
    def put(self, adapter: str, key: bytes, depth: int, ids: np.ndarray, kv: np.ndarray, states: list[bytes] | None,
            stamp_ns: int) -> bool:
        """Queue one block: its chain key, ``depth`` (its index in the chain: 0 is the first block), ids [b], K/V bytes
        and states (None: K/V alone); ``stamp_ns``: the store's time, its file's mtime less ``depth`` microseconds.
        False (dropped, counted) when the queue cannot take it or the tier is off."""
        size = int(kv.nbytes) + sum(len(s) for s in states or ())
        with self._cond:
            if not self.enabled or self._closed or self._pending + size > self.queue_bytes:
                self.stats.disk_dropped += 1
                return False
            self._queue.append(("write", (adapter, key, depth, ids, kv, states, stamp_ns), size))
            self._pending += size
            self._cond.notify()
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether the queue can take ``nbytes`` more now."""
        return self.enabled and not self._closed and self._pending + nbytes <= self.queue_bytes

    def touch(self, adapter: str, keys: list[bytes], stamp_ns: int) -> None:
        """Mark a chain's blocks (``keys``, first to last from depth 0) as used at ``stamp_ns``, each less its depth in
        microseconds (so an ancestor is never older than its descendants); done by the writer, dropped when the queue
        holds 4096 items."""
        if not self.enabled or not keys:
            return
        with self._cond:
            if not self._closed and len(self._queue) < 4096:
                self._queue.append(("touch", (adapter, keys, stamp_ns), 0))
                self._cond.notify()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write is done (False if ``timeout`` seconds pass first)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (at most ``timeout`` seconds), then stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._pending = 0
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # -- reads (loop thread, synchronous) -----------------------------------------------------------
    def read_chain(self, adapter: str, blocks: Iterable[tuple[bytes, np.ndarray]], kv_bytes: int,
                   state_bytes: list[int] | None) -> list[DiskBlock]:
        """The blocks ``(chain key, ids)`` (first to last) found on disk, up to the first missing one: each file read
        whole and validated; ``kv_bytes`` / ``state_bytes`` (None: K/V alone) the sizes a block must have. A damaged
        file ends the chain there, with its warning, and is deleted. The caller touches what it uses (``touch``)."""
        if not self.enabled:
            return []
        ident = self.identity(adapter)
        found: list[DiskBlock] = []
        for key, ids in blocks:
            path = self.root / ident / f"{key.hex()}.blk"
            try:
                rec = read_record(path, ident, KIND)
                block = self._check(rec, ids, kv_bytes, state_bytes, path)
            except FileNotFoundError:
                break
            except DamagedState as e:
                self._damaged(path, str(e))
                break
            except OSError as e:
                self._warn_once(str(path), f"decodert: prefix cache: cannot read {path} ({e.strerror or first_line(e)}); "
                                           "skipped")
                break
            if block is None:  # another prompt's block under this key: a miss, not damage
                break
            found.append(block)
        return found

    def _check(self, rec: Any, ids: np.ndarray, kv_bytes: int, state_bytes: list[int] | None, path: Path) -> DiskBlock | None:
        arrays = rec.arrays
        got = arrays.get("ids")
        kv = arrays.get("kv")
        if got is None or kv is None or got.dtype != np.int64 or kv.dtype != np.uint8 or kv.nbytes != kv_bytes:
            raise DamagedState(f"{path}: not a block of this cache ({kv_bytes}-byte K/V blocks)")
        if not np.array_equal(got, ids):
            return None
        n = rec.meta.get("states", 0)
        if state_bytes is None and n:
            raise DamagedState(f"{path}: holds states, which this model has none of")
        states = None
        if n:
            states = [arrays[f"state.{j}"].tobytes() if f"state.{j}" in arrays else b"" for j in range(int(n))]
            if [len(s) for s in states] != list(state_bytes or []):
                raise DamagedState(f"{path}: its states are not this model's ({state_bytes} bytes)")
        return DiskBlock(kv, states, int(kv.nbytes) + sum(len(x) for x in states or ()))

    # -- the writer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                what, payload, size = self._queue.popleft()
                self._busy = True
            try:
                if self.enabled:
                    (self._write if what == "write" else self._touch)(*payload)
            except OSError as e:
                self._off(f"cannot write to {self.root} ({e.strerror or first_line(e)})")
            except Exception as e:  # a bug here must not end serving: the tier goes off, loudly
                self._off(f"disk tier failed ({type(e).__name__}: {first_line(e)})")
            finally:
                with self._cond:
                    self._pending -= size
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, adapter: str, key: bytes, depth: int, ids: np.ndarray, kv: np.ndarray, states: list[bytes] | None,
               stamp_ns: int) -> None:
        ident = self.identity(adapter)
        folder = self.root / ident
        if ident not in self._made:
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / ABOUT).exists():
                about = {**self.about, "identity": ident, "adapter": adapter}
                fd, tmp = tempfile.mkstemp(prefix=f".{ABOUT}.", suffix=".tmp", dir=folder)
                with os.fdopen(fd, "w") as f:
                    json.dump(about, f)
                os.replace(tmp, folder / ABOUT)
            self._made.add(ident)
        path = folder / f"{key.hex()}.blk"
        if path.exists() and not is_tier_file(path):
            return  # someone else's file under a block's name: never replaced
        arrays = {"ids": ids, "kv": kv}
        for j, s in enumerate(states or ()):
            arrays[f"state.{j}"] = np.frombuffer(s, np.uint8)
        old = path.stat().st_size if path.exists() else 0
        n = write_record(path, ident, KIND, arrays, meta={"block_tokens": int(len(ids)), "states": len(states or ())})
        _stamp(path, stamp_ns - 1000 * depth)
        self.stats.disk_written_blocks += 1
        self.stats.disk_written_bytes += n
        self._bytes += n - old
        if self._bytes > self.budget_bytes:
            self._bytes = self._evict()
        self.stats.disk_bytes = self._bytes

    def _touch(self, adapter: str, keys: list[bytes], stamp_ns: int) -> None:
        folder = self.root / self.identity(adapter)
        for depth, key in enumerate(keys):
            _stamp(folder / f"{key.hex()}.blk", stamp_ns - 1000 * depth)

    # -- the directory -------------------------------------------------------------------------------
    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file of the tier under ``root`` (all identities); stale temp files
        left by a writer that died are deleted on the way."""
        out = []
        now = time.time()
        for sub in os.scandir(self.root):
            if not (_IDENTITY.match(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for f in os.scandir(sub.path):
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not f.is_file(follow_symlinks=False):
                    continue
                if _BLOCK.match(f.name):
                    out.append((st.st_mtime, st.st_size, Path(f.path)))
                elif _TEMP.match(f.name) and now - st.st_mtime > _STALE_TEMP_S:
                    Path(f.path).unlink(missing_ok=True)
        return out

    def _scan(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _evict(self) -> int:
        """Delete the oldest block files until the tier holds at most 90% of the budget -> the bytes it holds."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= 0.9 * self.budget_bytes:
                break
            if remove_block(path):
                total -= size
                self.stats.disk_evicted_blocks += 1
        return total

    def _damaged(self, path: Path, message: str) -> None:
        deleted = remove_block(path)
        self._warn_once(str(path), f"decodert: prefix cache: {message}; skipped" +
                        (" and deleted" if deleted else " (not a file of the tier: left as it is)"))
        self.stats.disk_damaged += 1

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def _off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning(f"decodert: prefix cache disk tier: {why}; it is off, the memory tier goes on serving")


def _stamp(path: Path, ns: int) -> None:
    """Set ``path``'s mtime (its recency in the LRU) to ``ns``; a file gone meanwhile is no matter."""
    try:
        os.utime(path, ns=(ns, ns))
    except FileNotFoundError:
        pass


def is_tier_file(path: Path) -> bool:
    """A file of a disk tier: a block (name and record magic, or shorter than the magic), a temp file of one, or
    about.json, inside a ``<24 hex>`` identity folder."""
    if not _IDENTITY.match(path.parent.name) or path.is_symlink() or not path.is_file():
        return False
    if _TEMP.match(path.name) or path.name == ABOUT:
        return True
    if not _BLOCK.match(path.name):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError:
        return False
    return head == MAGIC or (len(head) < len(MAGIC) and MAGIC.startswith(head))


def remove_block(path: Path) -> bool:
    """Delete ``path`` if it is a tier file (``is_tier_file``) -> whether it was deleted."""
    if not is_tier_file(path):
        return False
    try:
        path.unlink()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class TierInfo:
    """One identity folder of a disk tier, for ``decodert cache list``."""

    path: Path
    blocks: int
    bytes: int
    about: dict


def tiers(root: Path) -> list[TierInfo]:
    """The identity folders under ``root`` with their block files (none: [])."""
    out = []
    if not root.is_dir():
        return out
    for sub in sorted(root.iterdir()):
        if not (_IDENTITY.match(sub.name) and sub.is_dir() and not sub.is_symlink()):
            continue
        blocks = [p for p in sub.iterdir() if _BLOCK.match(p.name) and p.is_file() and not p.is_symlink()]
        try:
            about = json.loads((sub / ABOUT).read_text())
            about = about if isinstance(about, dict) else {}
        except (OSError, ValueError):
            about = {}
        out.append(TierInfo(sub, len(blocks), sum(p.lstat().st_size for p in blocks), about))
    return out


def clear_tiers(root: Path) -> tuple[int, int]:
    """Delete every tier file under ``root`` (and the identity folders left empty) -> (files, bytes) deleted.
    Nothing else in ``root`` is touched."""
    count = freed = 0
    for info in tiers(root):
        for p in sorted(info.path.iterdir()):
            size = p.lstat().st_size if p.exists() else 0
            if remove_block(p):
                count, freed = count + 1, freed + size
        try:
            info.path.rmdir()
        except OSError:
            pass  # something else is in it
    return count, freed
