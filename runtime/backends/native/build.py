"""The native decode step's C library (decode_step.c beside this file), compiled at first use for this CPU.

``cc -O3 -march=native -ffp-contract=off -shared -fPIC`` into ``$DECODERT_CACHE/native/decode_step-<key>.so`` (default
~/.cache/decodert), the key a hash of the source, the compiler's version line, the flags and the CPU's flags, so a changed
source, compiler or machine builds again and a later process loads the file. Where the CPU lacks AVX-512 VNNI or
there is no C compiler, ``refusal()`` says so in one line and the placement has no ``native-cpu`` candidate.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from decodert.errors import DecodertError, first_line

SOURCE = Path(__file__).with_name("decode_step.c")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # what the kernels' intrinsics need
P = ctypes.c_void_p
# -ffp-contract=off: no fused multiply-adds where the C code writes a product and a sum (the norms compute as ONNX
# Runtime's do); the kernels' own FMAs are intrinsics
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")

_built: dict[str, ctypes.CDLL | str] = {}  # "lib" -> the loaded library, or "why" -> the reason there is none


def cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler() -> str | None:
    """``$CC``, else cc, gcc or clang on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def refusal() -> str | None:
    """Why the library cannot be had here (None: it builds or is built)."""
    try:
        library()
    except DecodertError as e:
        return str(e)
    return None


def library() -> ctypes.CDLL:
    """The compiled library, built once per source / compiler / CPU and loaded once per process."""
    if "lib" in _built:
        return _built["lib"]  # type: ignore[return-value]
    if "why" in _built:
        raise DecodertError(str(_built["why"]))
    try:
        lib = _load()
    except DecodertError as e:
        _built["why"] = str(e)
        raise
    _built["lib"] = lib
    return lib


def _load() -> ctypes.CDLL:
    flags = cpu_flags()
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        raise DecodertError(f"the native decode step needs AVX-512 VNNI; this CPU lacks {', '.join(missing)}")
    cc = compiler()
    if cc is None:
        raise DecodertError("the native decode step is compiled at first use, and there is no C compiler here (cc, gcc, clang or $CC)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\n".join([*version, *CFLAGS, *sorted(flags)]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("DECODERT_CACHE") or Path.home() / ".cache" / "decodert") / "native"
    out = root / f"decode_step-{key}.so"
    if not out.is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DecodertError(f"the native decode step cannot be built into {root} ({e.strerror})") from None
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        cmd = [cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-lpthread", "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise DecodertError(f"the native decode step did not compile ({first_line(e)})") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise DecodertError(f"the native decode step did not compile with {cc} ({first_line(done.stderr)[:200]})")
        os.replace(tmp, out)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        raise DecodertError(f"the native decode step's library {out} does not load ({first_line(e)})") from None
    lib.nd_packed_bytes.restype = ctypes.c_size_t
    lib.nd_packed_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.nd_pack.argtypes = [P, P, P, ctypes.c_int, ctypes.c_int, P]
    lib.nd_start.restype = ctypes.c_int
    lib.nd_start.argtypes = [ctypes.c_int]
    lib.nd_create.restype = P
    lib.nd_create.argtypes = [P, P, P, P]
    lib.nd_free.argtypes = [P]
    lib.nd_forward.restype = ctypes.c_int
    lib.nd_forward.argtypes = [P, ctypes.c_int, P, P, P, P, ctypes.c_int, P]
    lib.nd_gemv_steps.restype = ctypes.c_int
    lib.nd_gemv_steps.argtypes = [ctypes.c_int, P, P, P, P, P]
    return lib
