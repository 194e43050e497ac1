"""ONNX Runtime sessions on the OpenVINO execution provider (``pip install onnxruntime-ep-openvino``, the
``openvino`` extra): the plugin library registered once per process, the provider picked by device.

Why the execution provider and not OpenVINO's own runtime reading the graph: both compile the same
OpenVINO model, and on SmolLM2's portable int4 prefill they ran within noise of each other (128 tokens:
329 vs 348 ms, 1024: 2.84 vs 2.90 s, 2 threads on the loaded 2-vCPU machine); the provider keeps
ONNX Runtime's IOBinding, so a prefill binds the host K/V buffers exactly as the MLAS session does.

What it takes: only graphs of standard ONNX ops. The ort target's graphs (com.microsoft
GroupQueryAttention, MatMulNBits, RotaryEmbedding, ...) fail at session creation ("Input names
mismatch between OpenVINO and ONNX"), so an ort artifact places its prefill here only through a
portable prefill graph written beside it (``decodert export --openvino-prefill``; manifest
``phase_graphs``). The portable graph is taken whole (one OpenVINO subgraph, no node falls back
to the CPU provider: ``session.disable_cpu_ep_fallback`` is set, so a graph it would split fails to open).

Precision: OpenVINO runs an fp32 graph in bf16 on a CPU with AMX/AVX-512 BF16 unless told otherwise
(``INFERENCE_PRECISION_HINT``); the placement's parity check decides whether that is close enough.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import onnxruntime as ort

from decodert.errors import DecodertError, first_line

PACKAGE = "onnxruntime_ep_openvino"
_lock = threading.Lock()
_registered: dict[str, Any] = {}  # "name" -> the EP name, "version" -> the plugin's version; {} until tried


def provider() -> str | None:
    """The OpenVINO EP's name once its plugin library is registered in this process (None: not installed,
    or its library does not load here)."""
    with _lock:
        if "name" in _registered:
            return _registered["name"]
        _registered["name"] = None
        try:
            import onnxruntime_ep_openvino as plugin  # the `openvino` extra

            name = plugin.get_ep_name()
            if not any(d.ep_name == name for d in ort.get_ep_devices()):
                ort.register_execution_provider_library(name, plugin.get_library_path())
            devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
        except (ImportError, OSError, RuntimeError, AttributeError):  # absent, or built for another ORT
            return None
        if devices:
            _registered["name"] = name
            _registered["version"] = str(dict(devices[0].ep_metadata).get("version", "?"))
        return _registered["name"]


def version() -> str | None:
    """The plugin's version (``ep_metadata``), once registered."""
    return _registered.get("version") if provider() else None


def config(exact: bool = False) -> dict[str, dict[str, str]]:
    """OpenVINO CPU properties the sessions load: ``$DECODERT_OPENVINO_CONFIG`` (a JSON object of CPU
    properties, e.g. ``{"INFERENCE_PRECISION_HINT": "bf16"}``) over the defaults: with ``exact`` (a float-weight
    artifact) f32, else OpenVINO's own (bf16 on an AMX CPU); runtime/backends/openvino/native.py ``properties``."""
    text = os.environ.get("DECODERT_OPENVINO_CONFIG", "")
    base = {"INFERENCE_PRECISION_HINT": "f32"} if exact else {}
    if not text:
        return {"CPU": base} if base else {}
    try:
        props = json.loads(text)
    except ValueError:
        props = None
    if not isinstance(props, dict) or not all(isinstance(v, (str, int, float)) for v in props.values()):
        raise DecodertError(f"DECODERT_OPENVINO_CONFIG must be a JSON object of OpenVINO CPU properties, got {text!r}")
    return {"CPU": {**base, **{str(k): str(v) for k, v in props.items()}}}


def open_session(path: Path, options: ort.SessionOptions, threads: int | None = None,
                 exact: bool = False) -> ort.InferenceSession:
    """A session for the graph at ``path`` on the OpenVINO EP, the whole graph or a DecodertError naming
    what it refused (no node falls back to the CPU provider); ``threads`` (or ``$DECODERT_THREADS``):
    OpenVINO's inference threads (default: its own, one per core)."""
    name = provider()
    if name is None:
        raise DecodertError("the OpenVINO execution provider is not installed (pip install 'decodert[openvino]')")
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    props = config(exact)
    threads = threads or int(os.environ.get("DECODERT_THREADS", "0")) or None
    settings = {"load_config": json.dumps(props)} if props else {}
    if threads:
        settings["num_of_threads"] = str(threads)
    options.add_provider_for_devices(devices, settings)
    try:
        return ort.InferenceSession(str(path), options)
    except Exception as e:  # EPFail / Fail: an op it refuses, a graph it would split
        raise DecodertError(f"{path}: the OpenVINO execution provider cannot take the graph ({first_line(e)[:300]})") from None
