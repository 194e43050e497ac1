"""Install the competitor runtimes (and the model builder's onnx-ir) by package name with pip, timing each install.

    python bench/install.py            # onnxruntime-genai and llama-cpp-python, if missing

llama-cpp-python has no CPU wheel on PyPI for this platform and builds llama.cpp from source;
``CMAKE_ARGS`` defaults to ``-DGGML_NATIVE=ON`` (tuned to this CPU) unless already set.
Nothing here vendors third-party code: pip fetches the packages from the registry.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass

PACKAGES = {"onnxruntime_genai": "onnxruntime-genai", "onnx_ir": "onnx-ir", "llama_cpp": "llama-cpp-python"}
# onnx-ir: needed by onnxruntime-genai's model builder (python -m onnxruntime_genai.models.builder)


@dataclass
class Install:
    package: str
    ok: bool
    seconds: float  # 0.0 when it was already installed
    note: str  # version, or why it failed (last line of pip's output)


def ensure(module: str, timeout_s: int = 3600) -> Install:
    """Import ``module`` or pip-install its package; never raises."""
    package = PACKAGES[module]
    version = _version(module)
    if version:
        return Install(package, True, 0.0, f"{version} (already installed)")
    env = dict(os.environ)
    if module == "llama_cpp":
        env.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", package], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["pip gave no output"]
        ok, note = proc.returncode == 0, tail[0]
    except subprocess.TimeoutExpired:
        ok, note = False, f"pip install timed out after {timeout_s} s"
    seconds = time.perf_counter() - t0
    importlib.invalidate_caches()
    version = _version(module) if ok else None
    return Install(package, bool(version), seconds, version or note)


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # ImportError, or a broken native library
        return None
    return str(getattr(mod, "__version__", "unknown version"))


if __name__ == "__main__":
    for name in PACKAGES:
        r = ensure(name)
        print(f"{r.package}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s: {r.note}", flush=True)
