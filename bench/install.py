"""Install the competitor runtimes (and the model builder's onnx-ir) by package name with pip, timing each install.

    python bench/install.py            # onnxruntime-genai and llama-cpp-python, if missing
    python bench/install.py --ov-venv ~/.cache/decodert-bench/venv-openvino   # OpenVINO GenAI, in a venv

OpenVINO GenAI (with optimum-intel and nncf for ``optimum-cli export openvino``, which bring torch and
transformers) goes into a virtual environment of its own, made with ``python -m venv`` when missing:
decodert never imports it, the benchmarks run it through that environment's interpreter
(bench/ovgenai_worker.py). Point ``--ov-venv`` at an existing environment to reuse it.

llama-cpp-python has no CPU wheel on PyPI for this platform and builds llama.cpp from source;
``CMAKE_ARGS`` defaults to ``-DGGML_NATIVE=ON`` (tuned to this CPU) unless already set.
Nothing here vendors third-party code: pip fetches the packages from the registry.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"onnxruntime_genai": "onnxruntime-genai", "onnx_ir": "onnx-ir", "llama_cpp": "llama-cpp-python"}
# onnx-ir: needed by onnxruntime-genai's model builder (python -m onnxruntime_genai.models.builder)
# the peer and its exporter (optimum-cli); optimum-intel 2.2 exports qwen3_5 (as image-text-to-text) only with
# transformers <= 5.2 (5.4: "Maximum required is 5.2.*"; 5.5 lacks the Qwen3_5DynamicCache it patches)
OV_PACKAGES = ("openvino-genai==2026.4.*", "optimum-intel", "nncf", "transformers==5.2.*")
DEFAULT_OV_VENV = Path.home() / ".cache" / "decodert-bench" / "venv-openvino"


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


def ensure_ov_venv(venv: Path, timeout_s: int = 3600) -> Install:
    """OpenVINO GenAI and optimum-cli in the virtual environment ``venv`` (made and pip-installed when
    either is missing); never raises. The note is openvino_genai's version, or why it failed."""
    python = venv / "bin" / "python"
    version = ov_venv_version(venv)
    if version:
        return Install(OV_PACKAGES[0], True, 0.0, f"{version} (already installed in {venv})")
    t0 = time.perf_counter()
    try:
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=600)
        proc = subprocess.run([str(python), "-m", "pip", "install", *OV_PACKAGES], capture_output=True, text=True,
                              timeout=timeout_s)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["pip gave no output"]
        note = tail[0]
    except subprocess.CalledProcessError as e:
        note = f"python -m venv {venv} failed: {(e.stderr or b'').decode()[-200:]}"
    except subprocess.TimeoutExpired:
        note = f"pip install timed out after {timeout_s} s"
    version = ov_venv_version(venv)
    return Install(OV_PACKAGES[0], bool(version), time.perf_counter() - t0, version or note)


def ov_venv_version(venv: Path) -> str | None:
    """openvino_genai's version in ``venv`` when it imports there and optimum-cli is beside it, else None."""
    python = venv / "bin" / "python"
    if not python.is_file() or not (venv / "bin" / "optimum-cli").is_file():
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", "import json, openvino_genai as g; print(json.dumps(g.__version__))"],
                          capture_output=True, text=True, env=env, timeout=300)
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # ImportError, or a broken native library
        return None
    return str(getattr(mod, "__version__", "unknown version"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench/install.py", description=__doc__.splitlines()[0])
    parser.add_argument("--ov-venv", type=Path, help="install OpenVINO GenAI into this venv (only that)")
    ov_venv = parser.parse_args().ov_venv
    for r in [ensure_ov_venv(ov_venv)] if ov_venv else [ensure(name) for name in PACKAGES]:
        print(f"{r.package}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s: {r.note}", flush=True)
