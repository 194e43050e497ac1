"""manifest.json: the artifact's contract (model spec, graph I/O, files and their hashes).

Written last, atomically, so a folder with a manifest is a complete artifact. Loading validates
the structure and (by default, cheaply) the files it names.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.export.sampling_defaults import check_record

FORMAT = "decodert-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_EDGE = 1 << 20  # fast verification hashes the first and last MiB
VERIFY_MODES = ("fast", "full", "none")

_REQUIRED = {
    "format": str, "format_version": int, "model": dict, "target": str, "dtype": str, "max_seq": int,
    "max_batch": int, "kv": dict, "graphs": dict, "weights": dict, "tokenizer": dict, "files": dict,
}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def edge_hash(path: Path) -> str:
    """sha256 of the first and last MiB plus the size: catches truncation and swapped files fast."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(size - _EDGE, _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path), "edge_sha256": edge_hash(path)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Atomically write ``folder/manifest.json`` (temp file + rename)."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load_manifest(folder: Path | str, verify: str = "fast") -> dict[str, Any]:
    """Read and validate ``folder/manifest.json``; verify files: "none" | "fast" | "full"."""
    if verify not in VERIFY_MODES:
        raise DecodertError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise DecodertError(f"{folder}: not a folder (expected an artifact made by 'decodert export')")
    if not path.is_file():
        raise DecodertError(f"{path}: missing; {folder} is not a decodert artifact (run 'decodert export' first)")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise DecodertError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    except OSError as e:
        raise DecodertError(f"{path}: cannot read ({e.strerror})") from None
    validate_manifest(manifest, path)
    if verify != "none":
        verify_files(folder, manifest, full=verify == "full")
    return manifest


def validate_manifest(m: Any, path: Path) -> None:
    """Check every field the loaders read has the right type and range; DecodertError names it."""
    if not isinstance(m, dict):
        raise DecodertError(f"{path}: expected a JSON object")
    for key, typ in _REQUIRED.items():
        if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
            raise DecodertError(f"{path}: field '{key}' is missing or not a {typ.__name__}")
    if m["format"] != FORMAT or m["format_version"] != FORMAT_VERSION:
        raise DecodertError(f"{path}: format {m['format']!r} v{m['format_version']} is not {FORMAT} v{FORMAT_VERSION}")
    for name, rec in m["files"].items():
        _need(safe_name(name), path, f"file entry {name!r} points outside the artifact folder")
        _need(isinstance(rec, dict) and _count(rec.get("size"), 0) and _hex(rec.get("sha256"))
              and (rec.get("edge_sha256") is None or _hex(rec["edge_sha256"])), path, f"files.{name} is malformed")
    _need(_count(m["max_seq"], 2) and _count(m["max_batch"], 1), path, "max_seq and max_batch must be integers >= 2 / >= 1")
    model = m["model"]
    _need(_count(model.get("vocab_size"), 1), path, "model.vocab_size must be a positive integer")
    _need(_id_list(model.get("eos_token_ids", [])) and _opt_id(model.get("bos_token_id")), path,
          "model.eos_token_ids / model.bos_token_id are malformed")
    kv = m["kv"]
    _need(all(_count(kv.get(k), 1) for k in ("num_layers", "num_kv_heads", "head_dim")), path,
          "kv.num_layers, kv.num_kv_heads and kv.head_dim must be positive integers")
    _need(kv.get("dtype", m["dtype"]) == m["dtype"], path, "kv.dtype differs from dtype")
    for kind in ("prefill", "decode"):
        g = m["graphs"].get(kind)
        _need(isinstance(g, dict) and _io_list(g.get("inputs")) and _io_list(g.get("outputs", [])), path,
              f"graphs.{kind} is missing or malformed")
        _listed(m, g.get("file"), path, f"graphs.{kind}.file")
    _check_contract(m, path)
    _check_verify(m, path)
    _listed(m, m["weights"].get("file"), path, "weights.file")
    _check_tokenizer(m["tokenizer"], m, path)
    if "sampling" in m:
        problem = check_record(m["sampling"])
        _need(problem is None, path, str(problem))
    engines = m.get("engines")
    _need(engines is None or isinstance(engines, dict), path, "engines is malformed")
    for name, rec in (engines or {}).items():
        _need(isinstance(rec, dict) and safe_name(rec.get("file")) and _count(rec.get("size"), 0)
              and _hex(rec.get("sha256")) and isinstance(rec.get("tensorrt", {}), dict), path,
              f"engines.{name} is malformed")


def runtime_io(m: dict) -> dict[str, tuple[str, list | None]]:
    """name -> (dtype, shape or None) of every graph input/output a backend binds."""
    kv = m["kv"]
    dtype = m["dtype"]  # what the backends allocate the cache in
    cache = ["batch", kv["num_kv_heads"], m["max_seq"], kv["head_dim"]]
    io: dict[str, tuple[str, list | None]] = {
        "input_ids": ("int64", None), "past_lengths": ("int64", ["batch"]), "seq_lengths": ("int64", ["batch"]),
        "logits": ("fp32", ["batch", m["model"]["vocab_size"]]), "next_token": ("int64", ["batch"])}
    for i in range(kv["num_layers"]):
        for name in ("past_key", "past_value", "present_key", "present_value"):
            io[f"{name}.{i}"] = (dtype, cache)
    return io


def _check_contract(m: dict, path: Path) -> None:
    """Each graph lists what the backends bind, with the dtypes and cache shapes kv/max_seq/vocab imply."""
    for kind in ("prefill", "decode"):
        g = m["graphs"][kind]
        listed = {t["name"]: t for t in g["inputs"] + g.get("outputs", [])}
        _need(2 * m["kv"]["num_layers"] + 3 <= len(g["inputs"]), path,
              f"kv.num_layers {m['kv']['num_layers']} does not match graphs.{kind}.inputs")
        bound = runtime_io(m)
        for name, (dtype, shape) in bound.items():
            t = listed.get(name)
            ok = t is not None and t["dtype"] == dtype and (shape is None or t["shape"] == shape)
            _need(ok, path, f"graphs.{kind}: {name!r} is missing or disagrees with kv/max_seq/model.vocab_size")
        extra = [t["name"] for t in g["inputs"] if t["name"] not in bound]  # an input nobody binds
        _need(not extra, path, f"graphs.{kind}: input {extra[:1]} is not one the runtime binds (kv.num_layers?)")


def _check_verify(m: dict, path: Path) -> None:
    """graphs.verify (speculative decoding; artifacts exported before it have none): the prefill
    contract without seq_lengths, per-position outputs, and its width per call."""
    g = m["graphs"].get("verify")
    if g is None:
        return
    _need(isinstance(g, dict) and _io_list(g.get("inputs")) and _io_list(g.get("outputs", []))
          and _count(g.get("max_tokens"), 1), path, "graphs.verify is malformed")
    _listed(m, g.get("file"), path, "graphs.verify.file")
    bound = runtime_io(m)
    bound.pop("seq_lengths"), bound.pop("logits"), bound.pop("next_token")
    bound["seq_logits"] = ("fp32", ["batch", "seq", m["model"]["vocab_size"]])
    bound["next_tokens"] = ("int64", ["batch", "seq"])
    listed = {t["name"]: t for t in g["inputs"] + g["outputs"]}
    for name, (dtype, shape) in bound.items():
        t = listed.get(name)
        ok = t is not None and t["dtype"] == dtype and (shape is None or t["shape"] == shape)
        _need(ok, path, f"graphs.verify: {name!r} is missing or disagrees with kv/max_seq/model.vocab_size")
    extra = [t["name"] for t in g["inputs"] if t["name"] not in bound]
    _need(not extra, path, f"graphs.verify: input {extra[:1]} is not one the runtime binds")


def safe_name(name: Any) -> bool:
    """A plain file name inside the artifact folder: no folders, no '..', not absolute, no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def _need(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise DecodertError(f"{path}: {what}")


def _count(value: Any, low: int) -> bool:
    return type(value) is int and value >= low


def _opt_id(value: Any) -> bool:
    return value is None or _count(value, 0)


def _id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_count(t, 0) for t in value)


def _hex(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _io_list(value: Any) -> bool:
    """[{"name": str, "dtype": str, "shape": [int | str, ...]}, ...]"""
    return isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list) and all(isinstance(d, (int, str)) for d in t["shape"]) for t in value)


def _listed(m: dict, name: Any, path: Path, what: str) -> None:
    """A file the loaders open must be a plain name that ``files`` lists (so it is verified)."""
    _need(safe_name(name), path, f"{what} {name!r} is not a file name inside the artifact folder")
    _need(name in m["files"], path, f"{what} {name!r} is not listed in 'files' (it could not be verified)")


def tokenizer_file(m: dict, folder: Path) -> Path:
    """The tokenizer file a runtime opens: it must be listed in ``files`` (so it was verified)."""
    name = m["tokenizer"].get("file") or "tokenizer.json"
    _listed(m, name, folder / MANIFEST, "tokenizer.file")
    return folder / name


def _check_tokenizer(tok: dict, m: dict, path: Path) -> None:
    # listed in files is checked where it is opened (tokenizer_file): `decodert build` needs no tokenizer
    _need(safe_name(tok.get("file", "tokenizer.json")), path, "tokenizer.file is not a file name in the artifact folder")
    ok = (_id_list(tok.get("eos_token_ids", [])) and _opt_id(tok.get("bos_token_id")) and _opt_id(tok.get("pad_token_id"))
          and isinstance(tok.get("add_bos_token", False), bool)
          and (tok.get("chat_template") is None or isinstance(tok["chat_template"], str))
          and (tok.get("vocab_size") is None or _count(tok["vocab_size"], 1)))
    _need(ok, path, "tokenizer token ids / add_bos_token / chat_template / vocab_size are malformed")


def verify_files(folder: Path, manifest: dict[str, Any], full: bool = False) -> None:
    """Sizes always; then the edge hash (fast) or the whole sha256 (full). Names the bad file."""
    for name, rec in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise DecodertError(f"{p}: missing (listed in the manifest)")
        size = p.stat().st_size
        if size != rec["size"]:
            raise DecodertError(f"{p}: size {size} does not match the manifest ({rec['size']}); the file is damaged")
        if full:
            ok = sha256_file(p) == rec["sha256"]
        else:
            ok = rec.get("edge_sha256") is None or edge_hash(p) == rec["edge_sha256"]
        if not ok:
            raise DecodertError(f"{p}: sha256 does not match the manifest; the file is damaged or was replaced")
