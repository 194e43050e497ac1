"""Where ``decodert export -o DIR`` writes: the destination check, the temp folder and the swap.

The protocol (crash-safe at every step, SIGKILL included):

1. ``prepare(DIR)`` resolves ``DIR`` and refuses a folder that holds anything besides a decodert
   artifact (a decodert ``manifest.json``, the files it lists, its engines); it deletes nothing (an
   old artifact a killed swap moved aside is put back where ``DIR`` is missing).
2. Once the export is accepted, ``make_temp`` cleans what earlier runs that died left beside ``DIR``
   (``recover``) and creates ``.DIR.tmp-PID-XXXXXXXX`` (a sibling, with the user's umask) holding
   ``MARKER``: the creating PID and a random token whose first 8 hex digits are the name's.
3. ``swap_in`` makes it ``DIR``. On Linux that is one ``renameat2(RENAME_EXCHANGE)`` call: at every
   instant ``DIR`` is the complete old artifact or the complete new one; the old one, now in the
   temp folder, is deleted after. Where the kernel or file system cannot exchange, the old folder
   is renamed to ``.DIR.old-PID-XXXXXXXX`` first and back if the second rename fails; a process killed
   between the two renames leaves it there, and the next export (``recover``) renames it back.
   The old artifact gets a copy of the marker before either, so wherever it lands it is provably
   decodert's; ``DIR`` loses its copy after the swap.
   SIGINT/SIGTERM/SIGHUP are held back during the swap (main thread) and delivered after it.

A leftover ``.DIR.tmp-PID-*`` or ``.DIR.old-PID-*`` is removed only when it holds the marker naming it
(that PID and the name's token) and process PID is gone: never a folder by its name alone (a user's
``.model.tmp-123-ab12cd34`` stays). ``MARKER`` is never part of an artifact: the manifest does not list
it, and one a killed swap left in ``DIR`` is allowed there and removed by the next ``recover``.

``terminating_raises`` makes SIGTERM and SIGHUP raise ``Terminated`` (a KeyboardInterrupt) during an
export, as SIGINT does, so the same cleanup removes the temp folder.

``decodert build`` uses the same swap: ``linked_copy`` makes the temp folder from hard links to
the artifact's files, the engines and the new manifest are written there, and the folder is
swapped in whole, so a build killed at any point leaves the old engines and manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

from decodert.errors import DecodertError, Terminated
from decodert.artifact.manifest import FORMAT, MANIFEST
from decodert.artifact.seq2seq import FORMAT as SEQ2SEQ_FORMAT, SEQ2SEQ_MANIFEST

_TMP, _OLD = ".tmp-", ".old-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_DEFERRED = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s))
_SHOWN = 5  # names listed in the "files in the way" error
MARKER = ".decodert-export"  # inside every folder decodert makes or moves aside: {"pid": int, "token": 32 hex}
_NAME_TOKEN = 8  # hex digits of the token in the folder's name


def prepare(out: str | Path) -> Path:
    """Check that ``out`` may be written or replaced; return it resolved (absolute, no ``..``)."""
    given = str(out)
    try:
        path = Path(out).resolve()
        cwd = Path.cwd().resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop, a deleted working folder
        raise DecodertError(f"-o {given}: cannot resolve the path ({e})") from None
    if path == Path(path.anchor) or path == cwd or path in cwd.parents:
        raise DecodertError(f"-o {given}: is the current folder or contains it; name the artifact folder, e.g. -o ./model")
    if path.exists() and not path.is_dir():
        raise DecodertError(f"-o {given}: exists and is not a folder")
    if path.is_dir():
        _check_replaceable(path, given)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DecodertError(f"-o {given}: cannot create {path.parent} ({e.strerror or e})") from None
    recover(path, clean=False)  # nothing deleted before the export is accepted (make_temp cleans)
    return path


def _check_replaceable(path: Path, given: str) -> None:
    """A folder is replaced only if it is empty or holds a decodert artifact and nothing else."""
    try:
        entries = sorted(path.iterdir())
    except OSError as e:
        raise DecodertError(f"-o {given}: cannot list the folder ({e.strerror or e})") from None
    if not entries:
        return
    owned = _artifact_files(path / MANIFEST)
    if owned is None:  # an encoder-decoder artifact (artifact/seq2seq.py) is one too
        owned = _artifact_files(path / SEQ2SEQ_MANIFEST, SEQ2SEQ_FORMAT)
    if owned is None:
        names = ", ".join(p.name for p in entries[:_SHOWN]) + (", ..." if len(entries) > _SHOWN else "")
        raise DecodertError(f"-o {given}: exists, is not empty and is not a decodert artifact ({names}); "
                            "choose another -o")
    extra = [p for p in entries
             if (p.name not in owned and not _staged(p.name) and p.name != MARKER) or p.is_symlink() or not p.is_file()]
    if extra:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in extra[:_SHOWN])
        more = f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else ""
        raise DecodertError(f"-o {given}: holds files that are not part of the decodert artifact ({names}{more}); "
                            "move them away or choose another -o")


def _artifact_files(manifest: Path, fmt: str = FORMAT) -> set[str] | None:
    """The names a decodert manifest (of format ``fmt``) owns (itself, ``files``, engines); None if it is not one."""
    try:
        if not manifest.is_file() or manifest.is_symlink() or manifest.stat().st_size > 64 << 20:
            return None
        m = json.loads(manifest.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(m, dict) or m.get("format") != fmt:
        return None
    owned = {manifest.name}
    if isinstance(m.get("files"), dict):
        owned.update(k for k in m["files"] if isinstance(k, str))
    engines = m.get("engines")
    for rec in (engines.values() if isinstance(engines, dict) else ()):
        if isinstance(rec, dict) and isinstance(rec.get("file"), str):
            owned.add(rec["file"])
    return owned


def _staged(name: str) -> bool:
    """Files an interrupted ``write_manifest`` / ``decodert build`` may leave inside an artifact."""
    return name.startswith(".") and name.endswith((".tmp", ".new"))


def make_temp(out: Path) -> Path:
    """Clean what dead runs left beside ``out`` (``recover``), then create ``.NAME.tmp-PID-XXXXXXXX``
    there with the user's umask (not 0700), holding its ``MARKER``. Called once the export is accepted."""
    recover(out)
    for _ in range(100):
        token = secrets.token_hex(16)
        tmp = out.with_name(f".{out.name}{_TMP}{os.getpid()}-{token[:_NAME_TOKEN]}")
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        except OSError as e:
            raise DecodertError(f"-o {out}: cannot create a folder in {out.parent} ({e.strerror or e})") from None
        try:
            (tmp / MARKER).write_text(json.dumps({"pid": os.getpid(), "token": token}), encoding="utf-8")
        except BaseException as e:  # a disk error, or a signal between the two calls
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise DecodertError(f"-o {out}: cannot write in {tmp} ({e.strerror or e})") from None
            raise
        return tmp
    raise DecodertError(f"-o {out}: could not pick a free temporary folder name in {out.parent}")


def linked_copy(out: Path) -> Path | None:
    """A temp sibling of artifact folder ``out`` holding hard links to its files (no data copied),
    to update and then ``swap_in`` whole (``decodert build``); None where that cannot be done (hard
    links refused by the file system, a sub-folder or symlink inside, ``out`` holding the working
    folder): the caller then updates ``out`` in place."""
    out = out.resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents or out == Path(out.anchor):
        return None
    tmp = make_temp(out)
    try:
        for p in out.iterdir():
            if p.name == MARKER:  # one a killed swap left: not the artifact's
                continue
            if p.is_symlink() or not p.is_file():
                raise OSError(f"{p.name} is not a plain file")
            os.link(p, tmp / p.name)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return tmp


def swap_in(tmp: Path, out: Path) -> None:
    """Make the finished folder ``tmp`` (made by ``make_temp``) the artifact ``out`` (see the module docstring)."""
    with _signals_deferred():
        try:
            if not os.path.lexists(out):
                os.rename(tmp, out)
            else:
                shutil.copyfile(tmp / MARKER, out / MARKER)  # the old artifact, wherever it lands, is ours to delete
                if _exchange(tmp, out):
                    shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old artifact
                else:
                    _swap_by_renames(tmp, out)
        except OSError as e:
            raise DecodertError(f"-o {out}: cannot move the new artifact into place ({e.strerror or e})") from None
        finally:
            _unmark(out)  # the new artifact, or the old one put back


def _unmark(folder: Path) -> None:
    with contextlib.suppress(OSError):
        (folder / MARKER).unlink(missing_ok=True)


def _swap_by_renames(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}{_OLD}{tmp.name[len(out.name) + 1 + len(_TMP):]}")  # tmp's PID-XXXXXXXX
    if os.path.lexists(old):  # never ours to replace: tmp's name was free when it was made
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(old))
    try:
        os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:  # a failed swap must not leave no artifact: put the old one back
        if os.path.lexists(old) and not os.path.lexists(out):
            os.rename(old, out)
        raise
    finally:
        if os.path.lexists(out):
            shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two folders (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def recover(out: Path, clean: bool = True) -> None:
    """After export runs whose process is gone, beside ``out``: put an old artifact one moved aside
    back in place when ``out`` is missing; with ``clean``, delete their other folders and the marker
    one left in ``out``. Only folders holding the marker that names them count (``_ours``)."""
    pattern = re.compile(re.escape(f".{out.name}") + rf"({re.escape(_TMP)}|{re.escape(_OLD)})(\d+)-([0-9a-f]{{{_NAME_TOKEN}}})")
    try:
        siblings = sorted((p for p in out.parent.iterdir() if pattern.fullmatch(p.name)), key=lambda p: p.name)
    except OSError:
        return
    for p in siblings:
        kind, pid, name_token = pattern.fullmatch(p.name).groups()  # type: ignore[union-attr]
        if _alive(int(pid)) or not _ours(p, int(pid), name_token):
            continue
        if kind == _OLD and not os.path.lexists(out):
            with contextlib.suppress(OSError):
                os.rename(p, out)
                _unmark(out)
                continue
        if clean:
            shutil.rmtree(p, ignore_errors=True)
    stray = _marker(out) if clean else None
    if stray is not None and not _alive(stray["pid"]):
        _unmark(out)


def _marker(folder: Path) -> dict | None:
    """The ``MARKER`` in ``folder`` ({"pid", "token"}), or None when there is none or it is not one of ours."""
    path = folder / MARKER
    try:
        if folder.is_symlink() or path.is_symlink() or not path.is_file() or path.stat().st_size > 4096:
            return None
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(m, dict) and type(m.get("pid")) is int and isinstance(m.get("token"), str) \
        and re.fullmatch(r"[0-9a-f]{32}", m["token"]) is not None
    return m if ok else None


def _ours(folder: Path, pid: int, name_token: str) -> bool:
    """Did a decodert process ``pid`` make (or move aside) ``folder``: a real folder whose marker names it?"""
    m = _marker(folder)
    return folder.is_dir() and m is not None and m["pid"] == pid and m["token"][:_NAME_TOKEN] == name_token


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # this process (another thread may be exporting there)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP during the block (main thread only); deliver them after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in _DEFERRED:
        with contextlib.suppress(ValueError, OSError):
            previous[sig] = signal.signal(sig, lambda s, _f: caught.append(s))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


@contextlib.contextmanager
def terminating_raises() -> Iterator[None]:
    """During the block (main thread only), SIGTERM and SIGHUP raise ``Terminated`` (a KeyboardInterrupt)
    where they would have ended the process: the cleanup SIGINT gets then runs for them too. A handler
    someone else installed, or an ignored signal (``nohup``), is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """The temp folder an export of ``out`` writes into (``make_temp``), under ``terminating_raises``; the block
    ends with ``swap_in``. Whatever stops the block removes the temp folder; an OSError (disk full, permissions, a
    file system that went away) is the one-line error naming ``-o out``."""
    with terminating_raises():
        tmp = make_temp(out)
        try:
            yield tmp
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DecodertError(f"-o {out}: writing the artifact failed ({e.strerror or e})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
