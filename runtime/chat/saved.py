"""Sessions on disk: ``Session.save(path)`` writes a conversation and its cache row, ``LLM.resume(path)`` reads it
back into a new session whose next turn is the one the live session would have given (docs/features/persistence.md).

The file is one state record (runtime/persist/records.py: checksummed, written atomically, refused whole when
damaged), kind ``"session"``, under the artifact's identity (``artifact_identity``: weights, graphs, dtype,
kv_dtype, K/V geometry, the state version):

    meta    session_version, system (str | None), overflow, turns (the messages after the system message,
            as JSON; an image part's image is {"saved": "image.K", "sha256": pixel digest}, a video's
            {"saved": "video.K", ...}), model (``model_key``: the identity less what a kv_dtype changes),
            kv_dtype (the K/V element type of the arrays), positions, snapshot (a hybrid row's snapshot
            position, or None)
    arrays  ids       int64 [n]      the ids whose K/V the row holds (``KVCache.held``)
            kv        uint8 [bytes]  the row's K/V of positions 0..n-1 (``backend.read_kv`` then ``kv_to_bytes``:
                                     each buffer's [H_kv, n, D] back to back, one layout for host and device)
            state.J   uint8          a hybrid row's states after those ids (``KVCache.read_states``)
            snapshot.J uint8         its snapshot's states, where it has one (the prompt's end of its last turn)
            image.K   uint8 [H, W, 3]   each image as decoded (RGB): the pixels its image ids were made from
            video.K   uint8 [T, H, W, 3]
            audio.K   float32 [N]      each audio clip as the model read it (decoded, at its sampling rate)

Images are kept as their decoded pixels, not as the path or URL they came from, so a resumed session renders
the same image ids whatever happened to the file since (``session.history`` then shows arrays). Resuming
writes K/V through the backend's ``kv_from_bytes`` / ``write_kv`` and records them with ``KVCache.commit``
(with the states, and the snapshot by a commit up to it), so the row holds exactly the ids it says. A row
that ran under a LoRA adapter is saved under the adapter's content key too (``Adapters.key_of``: the record's
identity and meta ``adapter`` {name, key}); it resumes only where an adapter of that name with that key is
loaded, and is then recorded under it (``KVCache.use_adapter``) before the commit.

A file of another artifact is refused in one line. One whose only difference is the K/V element type loads
only with ``convert_kv=True``, between fp32, fp16 and bf16: ``astype``, round to nearest even, as the graphs'
Cast into the cache rounds; int8 / int4 / fp8 caches hold codes under the artifact's calibrated scales and
are never converted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from decodert.artifact.records import to_json
from decodert.errors import DamagedState, DecodertError
from decodert.plugins.ops.kv_dtypes import KV_DTYPES, NUMPY_STORAGE
from decodert.runtime.chat.chat import check_messages
from decodert.runtime.persist.records import artifact_identity, read_record, write_record
from decodert.runtime.audio.messages import PARTS as AUDIO_PARTS, has_audio
from decodert.runtime.vision.messages import PARTS, split_images
from decodert.runtime.vision.video import Video

KIND = "session"
SESSION_VERSION = 1
FLOAT_KV = ("fp32", "fp16", "bf16")  # what convert_kv converts between


@dataclass
class SavedSession:
    """A session file read and checked against an LLM: the conversation, and what goes into its row."""

    system: str | None
    overflow: str
    turns: list[dict]
    ids: np.ndarray  # [n] int64
    kv: np.ndarray | None  # [bytes] uint8 in this LLM's K/V element type; None: no row saved
    states: list[bytes]
    snapshot: tuple[int, list[bytes]] | None
    adapter: tuple[int, int] = (0, 0)  # (LoRA slot, load tag) the row's K/V were computed under; (0, 0): none
    path: str = "session"  # the file, for errors

    def fill(self, llm: Any, cache: Any) -> None:
        """Write the row into slot 0 of ``cache`` (an empty one-slot cache) through the backend's verbs and commit it."""
        n = len(self.ids)
        if self.kv is None or n == 0:
            return
        cache.use_adapter(0, *self.adapter)
        if n > cache.max_seq - 1:
            raise DecodertError(f"{self.path}: the session holds {n} tokens; this model's context is {cache.max_seq} "
                                "(--max-seq)")
        sizes = [cache.state_bytes] if self.snapshot is None else [cache.state_bytes, cache.state_bytes]
        if [[len(b) for b in st] for st in [self.states, *([self.snapshot[1]] if self.snapshot else [])]] != sizes:
            raise DamagedState(f"{self.path}: damaged session file (its states are not this model's)")
        backend = llm.backend
        try:
            block = backend.kv_from_bytes(cache, self.kv, n)
        except ValueError as e:
            raise DamagedState(f"{self.path}: damaged session file (its K/V do not fit this model's cache: {e})") from None
        try:
            backend.write_kv(cache, 0, 0, block)
        finally:
            backend.free_kv(block)
        if self.snapshot is not None and 0 < self.snapshot[0] < n:  # the row can go back there, as the live one could
            at, snap = self.snapshot
            cache.commit([0], [self.ids[:at]], states=[snap])
            cache.snapshot(0)
            cache.commit([0], [self.ids[at:]], states=[self.states])
        else:
            cache.commit([0], [self.ids], states=[self.states] if cache.has_state else None)


def model_key(manifest: Any) -> str:
    """What a session's K/V depend on except their element type: the weights, the model's dtype, the K/V and
    state geometry, the tokenizer and the vision graph. Two artifacts with one key differ at most in kv_dtype."""
    files = manifest.files
    kv = {k: v for k, v in to_json(manifest.kv).items() if k not in ("dtype", "scales")}
    fields = {"weights": getattr(files.get(manifest.weights.file), "sha256", None), "dtype": manifest.dtype, "kv": kv,
              "tokenizer": {name: rec.sha256 for name, rec in sorted(files.items()) if name.startswith("tokenizer")},
              "vision": None if manifest.vision is None else getattr(files.get(manifest.vision.graph.file), "sha256", None)}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def kv_dtype_of(manifest: Any) -> str:
    return manifest.kv_dtype or manifest.dtype


# ---------------------------------------------------------------- write
def write_session(path: str | Path, llm: Any, system: str | None, overflow: str, turns: Sequence[Mapping],
                  row: Any) -> int:
    """Write a session file (see the module docstring) -> its bytes. DecodertError: a message that is not JSON,
    an artifact without hashes, a path that cannot be written (nothing is left behind then)."""
    path = Path(path)
    manifest = llm.manifest
    if manifest is None:
        raise DecodertError("this LLM has no artifact manifest: its sessions cannot be saved")
    arrays: dict[str, np.ndarray] = {}
    saved_turns = [_saved_message(m, i, llm, arrays) for i, m in enumerate(turns)]
    cache = row.cache if row is not None else None
    tag = cache.adapter_tag(0) if cache is not None else 0
    key = llm.adapters.key_of(tag) if tag else ""
    adapter = None
    if tag:
        name = next((a for a in llm.adapters.names if llm.adapters.info(a).tag == tag), None)
        if name is None or not key:
            raise DecodertError("the session's row ran under a LoRA adapter that is no longer loaded (or whose files "
                                "cannot be read for its key); its K/V cannot be saved: reset() the session or reload it")
        adapter = {"name": name, "key": key}
    n = 0 if cache is None else int(cache.lengths[0])
    snapshot = None
    arrays["ids"] = cache.held(0) if n else np.zeros(0, np.int64)
    if n:
        backend = llm.backend
        block = backend.read_kv(cache, 0, 0, n)
        try:
            arrays["kv"] = np.ascontiguousarray(backend.kv_to_bytes(block)).view(np.uint8).reshape(-1)
        finally:
            backend.free_kv(block)
        for j, raw in enumerate(cache.read_states(0)):
            arrays[f"state.{j}"] = np.frombuffer(raw, np.uint8)
        snap = cache.read_snapshot(0) if cache.has_state else None
        if snap is not None and 0 < snap[0] < n:
            snapshot = snap[0]
            for j, raw in enumerate(snap[1]):
                arrays[f"snapshot.{j}"] = np.frombuffer(raw, np.uint8)
    meta = {"session_version": SESSION_VERSION, "system": system, "overflow": overflow, "turns": saved_turns,
            "model": model_key(manifest), "kv_dtype": kv_dtype_of(manifest), "positions": n, "row": n > 0,
            "snapshot": snapshot, "adapter": adapter}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise DecodertError(f"the session cannot be saved: a message holds something that is not JSON ({e})") from None
    try:
        return write_record(path, artifact_identity(manifest, key), KIND, arrays, meta)
    except OSError as e:
        raise DecodertError(f"{path}: cannot write the session: {e.strerror or type(e).__name__}") from None


def _saved_message(m: Mapping, i: int, llm: Any, arrays: dict[str, np.ndarray]) -> dict:
    """A message with its image and video parts replaced by references to arrays (decoded pixels) in ``arrays``,
    and its audio parts by the clips as the model reads them (float32 samples at its rate)."""
    if has_audio([m]):
        m = _saved_audio(m, llm, arrays)
    content = m.get("content")
    if not isinstance(content, list) or not any(isinstance(p, Mapping) and p.get("type") in PARTS for p in content):
        return dict(m)
    _, media = split_images([m], llm.image_limits, llm.fetch_image)
    it = iter(media)
    parts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") in PARTS):
            parts.append(part)
            continue
        item = next(it)
        if isinstance(item, Video):
            name = f"video.{sum(k.startswith('video.') for k in arrays)}"
            arrays[name] = item.frames
            parts.append({"type": "video", "video": {"saved": name, "sha256": _digest(item.frames)}, "fps": item.fps})
        else:
            name = f"image.{sum(k.startswith('image.') for k in arrays)}"
            arrays[name] = item
            parts.append({"type": "image", "image": {"saved": name, "sha256": _digest(item)}})
    return {**m, "content": parts}


def _saved_audio(m: Mapping, llm: Any, arrays: dict[str, np.ndarray]) -> dict:
    """``m`` with each audio part replaced by ``{"type": "audio", "audio": {"saved": "audio.K", "sha256": ...},
    "sample_rate": rate}``, the clip (decoded, resampled: the samples its audio ids were made from) in ``arrays``."""
    (_, clips) = llm.split_audio([m])
    it = iter(clips)
    parts = []
    for part in m["content"]:
        if isinstance(part, Mapping) and part.get("type") in AUDIO_PARTS:
            clip = np.ascontiguousarray(next(it), np.float32)
            name = f"audio.{sum(k.startswith('audio.') for k in arrays)}"
            arrays[name] = clip
            parts.append({"type": "audio", "audio": {"saved": name, "sha256": _digest(clip)},
                          "sample_rate": int(llm.audio.sampling_rate)})
        else:
            parts.append(part)
    return {**m, "content": parts}


def _digest(pixels: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()


# ---------------------------------------------------------------- read
def read_session(path: str | Path, llm: Any, convert_kv: bool = False) -> SavedSession:
    """A session file checked against ``llm``'s artifact (see the module docstring). DamagedState: a damaged,
    truncated or foreign file; DecodertError: an unreadable path, another kv_dtype without ``convert_kv``."""
    path = Path(path)
    manifest = llm.manifest
    if manifest is None:
        raise DecodertError("this LLM has no artifact manifest: it cannot resume a saved session")
    try:
        rec = read_record(path, None, KIND)
    except OSError as e:
        raise DecodertError(f"{path}: cannot read the session: {e.strerror or type(e).__name__}") from None
    meta, arrays = rec.meta, rec.arrays

    def bad(what: str) -> DamagedState:
        return DamagedState(f"{path}: damaged session file ({what})")

    if meta.get("session_version") != SESSION_VERSION:
        raise DamagedState(f"{path}: session format version {meta.get('session_version')!r}; this decodert reads "
                           f"version {SESSION_VERSION}")
    here = kv_dtype_of(manifest)
    theirs = meta.get("kv_dtype")
    key, adapter = _adapter(path, llm, meta.get("adapter"))
    identity = artifact_identity(manifest, key)
    if rec.identity != identity:
        if meta.get("model") != model_key(manifest) or theirs == here:
            raise DamagedState(f"{path}: saved from another artifact, adapter or decodert version (identity "
                               f"{rec.identity}, this model's {identity})")
        if not convert_kv:
            raise DecodertError(f"{path}: saved with a {theirs} K/V cache, this model's is {here}; resume with "
                                "convert_kv=True (--convert-kv) to convert it")
        if theirs not in FLOAT_KV or here not in FLOAT_KV:
            raise DecodertError(f"{path}: its {theirs} K/V cannot be converted to {here} exactly as the cache would "
                                f"store them (only {', '.join(FLOAT_KV)} convert); start the session again")
    system, overflow, turns = meta.get("system"), meta.get("overflow"), meta.get("turns")
    if not (system is None or isinstance(system, str)) or not isinstance(overflow, str) or not isinstance(turns, list) \
            or not all(isinstance(m, dict) for m in turns):
        raise bad("system, overflow or turns")
    ids = arrays.get("ids")
    n = meta.get("positions")
    if ids is None or ids.dtype != np.int64 or ids.ndim != 1 or type(n) is not int or len(ids) != n:
        raise bad("ids")
    kv = arrays.get("kv") if meta.get("row") else None
    if meta.get("row") and (kv is None or kv.dtype != np.uint8):
        raise bad("kv")
    if kv is not None and theirs != here:
        kv = _convert(kv, theirs, here)
    if kv is not None and kv.nbytes != llm.backend.kv_bytes(n):
        raise bad(f"kv: {kv.nbytes} bytes for {n} positions")
    states = _indexed(arrays, "state")
    at = meta.get("snapshot")
    snapshot = None
    if at is not None:
        if type(at) is not int or not 0 < at < n:
            raise bad("snapshot")
        snapshot = (at, _indexed(arrays, "snapshot"))
    messages = [_read_message(m, arrays, bad) for m in turns]
    try:
        messages = check_messages(messages) if messages else []
    except DecodertError as e:
        raise bad(f"turns: {e}") from None
    return SavedSession(system, overflow, messages, ids, kv, states, snapshot, adapter, str(path))


def _adapter(path: Path, llm: Any, saved: Any) -> tuple[str, tuple[int, int]]:
    """The saved row's adapter -> (its key for the identity, (slot, tag) of the same adapter loaded here)."""
    if saved is None:
        return "", (0, 0)
    name, key = (saved.get("name"), saved.get("key")) if isinstance(saved, dict) else (None, None)
    if not isinstance(name, str) or not isinstance(key, str) or not key:
        raise DamagedState(f"{path}: damaged session file (adapter)")
    loaded = llm.adapters.info(name) if name in llm.adapters.names else None
    if loaded is None or loaded.key != key:
        raise DamagedState(f"{path}: saved under LoRA adapter {name!r} ({key}), which is not loaded here with the same "
                           f"files; load it as {name!r} (LLM.load(adapters=...)) to resume")
    return key, (loaded.slot, loaded.tag)


def _indexed(arrays: Mapping[str, np.ndarray], prefix: str) -> list[bytes]:
    out, j = [], 0
    while f"{prefix}.{j}" in arrays:
        out.append(arrays[f"{prefix}.{j}"].tobytes())
        j += 1
    return out


def _convert(kv: np.ndarray, theirs: str, here: str) -> np.ndarray:
    """K/V bytes of element type ``theirs`` -> the same values in ``here``, rounded as a cast into the cache rounds."""
    src, dst = NUMPY_STORAGE[KV_DTYPES[theirs].storage], NUMPY_STORAGE[KV_DTYPES[here].storage]
    if kv.nbytes % src.itemsize:
        raise DamagedState(f"the session's K/V are not whole {theirs} values")
    return np.ascontiguousarray(kv.view(src).astype(dst)).view(np.uint8)


def _read_message(m: dict, arrays: Mapping[str, np.ndarray], bad: Any) -> dict:
    content = m.get("content")
    if not isinstance(content, list):
        return m
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "audio" and isinstance(part.get("audio"), dict):
            ref = part["audio"]
            name = ref.get("saved")
            clip = arrays.get(name) if isinstance(name, str) and name.startswith("audio.") else None
            if clip is None or clip.dtype != np.float32 or clip.ndim != 1 or ref.get("sha256") != _digest(clip) \
                    or not isinstance(part.get("sample_rate"), int):
                raise bad(f"audio {name!r}")
            parts.append({"type": "audio", "audio": clip, "sample_rate": part["sample_rate"]})
            continue
        if kind not in ("image", "video"):
            parts.append(part)
            continue
        ref = part.get(kind)
        name = ref.get("saved") if isinstance(ref, dict) else None
        pixels = arrays.get(name) if isinstance(name, str) and name.startswith(f"{kind}.") else None
        if pixels is None or pixels.dtype != np.uint8 or pixels.ndim != (3 if kind == "image" else 4) \
                or pixels.shape[-1] != 3 or ref.get("sha256") != _digest(pixels):
            raise bad(f"{kind} {name!r}")
        parts.append({"type": "image", "image": pixels} if kind == "image" else
                     {"type": "video", "video": pixels, "fps": part.get("fps")})
    return {**m, "content": parts}

