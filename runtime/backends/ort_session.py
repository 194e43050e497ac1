"""How decodert's ONNX Runtime sessions are made: options (threads, spinning, pinned workers), execution
providers, and a graph's session with decodert's plugin nodes expanded. The ort backend (runtime/backends/ort/)
opens its graphs with it and the vision encoder (runtime/vision/encoder.py) vision.onnx, so it sits beside both."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnxruntime as ort

from decodert.errors import DecodertError, first_line
from decodert.plugins.expand import expand_plugin_nodes
from decodert.plugins.registry import DOMAIN as PLUGIN_DOMAIN


def open_session(path: Path, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """A session for the graph at ``path``; decodert plugin nodes (``--plugins``) are expanded into
    their reference bodies first, with external data still read from the artifact folder."""
    source: str | bytes = str(path)
    graph = onnx.load(str(path), load_external_data=False)
    if any(n.domain == PLUGIN_DOMAIN for n in graph.graph.node):
        source = expand_plugin_nodes(graph).SerializeToString()
        key = "session.model_external_initializers_file_folder_path"
        try:
            known = options.get_session_config_entry(key)
        except RuntimeError:  # not set yet
            known = None
        if known != str(path.parent):
            options.add_session_config_entry(key, str(path.parent))
    try:
        return ort.InferenceSession(source, options, providers=providers)
    except Exception as e:  # onnxruntime's Fail / InvalidGraph / InvalidProtobuf on a damaged graph
        text = first_line(e)[:300]
        raise DecodertError(f"{path}: ONNX Runtime cannot load the graph ({type(e).__name__}: {text})") from None


def session_options(threads: int | None) -> ort.SessionOptions:
    """Options of every session. A backend has several (prefill/decode and verify; a draft model
    its own) that run one after another: each session's pool stops spinning when its run ends,
    else the pool that just ran keeps its threads spinning on the cores the next session needs
    (SmolLM2 fp32 on 2 cores, alternating decode and a 5-token verify: 41.1 / 48.9 ms per call
    with spinning pools, 21.8 / 25.1 ms without; alone 21.5 / 26.8 ms)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # TensorScatter/ScatterND in-place notices are expected
    so.add_session_config_entry("session.force_spinning_stop", "1")
    threads = threads or int(os.environ.get("DECODERT_THREADS", "0")) or None
    if threads:
        so.intra_op_num_threads = threads
        pins = thread_pins(threads, os.environ.get("DECODERT_PIN_THREADS", ""))
        if pins:
            so.add_session_config_entry("session.intra_op_thread_affinities", pins)
    return so


def thread_pins(threads: int, setting: str) -> str:
    """ORT's affinity string pinning the pool's workers (all but the caller's thread) one per core,
    from the cores this process may use, when ``$DECODERT_PIN_THREADS`` is 1; else "".
    Off by default: measured on this project's 2-vCPU machine it changed nothing
    (docs/benchmarks/history.md, "Sizes users deploy (issue 32)"), and pinning fights other processes for the same cores."""
    if setting in ("", "0"):
        return ""
    if setting != "1":
        raise DecodertError(f"DECODERT_PIN_THREADS must be 0 or 1, got '{setting}'")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if threads < 2 or len(cores) < threads:
        return ""
    # ORT numbers logical processors from 1; worker i (of threads - 1) takes core i (core 0: the caller)
    return ";".join(str(cores[i] + 1) for i in range(1, threads))


def default_providers() -> list[str]:
    """CUDA EP when onnxruntime-gpu is installed, cuda-python can see a GPU; else the CPU."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            from decodert.plugins.cuda_mem import gpu_count

            if gpu_count() > 0:
                return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        except (ImportError, DecodertError):
            pass
    return ["CPUExecutionProvider"]
