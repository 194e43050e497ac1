"""OpenVINO's own runtime running the ort target's prefill graph (``openvino.Core().read_model``), one row a call.

OpenVINO reads the ort target's com.microsoft ops (MatMulNBits -> a compressed FullyConnected, GroupQueryAttention
-> its own attention op) where its ONNX Runtime execution provider refuses them, and prefills them several times
faster than MLAS on an AMX / AVX-512 VNNI CPU. Its attention does not write a shared cache in place: it appends the
new K/V to the past it is given (present [1, H, past + n, D]). So a call feeds the rows the slot holds so far
(``past_*`` reshaped to [1, H_kv, ?, D]: nothing for a fresh prompt, a copy of the held rows otherwise) and copies
only the n new rows of ``present_*`` into the cache buffers; the decode step (MLAS) then reads them in place.
(Found by the "peers" helper of issue 47, bench/ov_prefill.py.) A whole prompt runs in one call: OpenVINO's
attention has no cost over the square that made the ort backend cut long prompts into 512-token chunks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from decodert.errors import DecodertError, first_line


def available() -> bool:
    """Is OpenVINO's Python runtime installed (the ``openvino`` package)?"""
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def properties(threads: int | None, exact: bool = False) -> dict[str, Any]:
    """The CPU plugin's properties: ``$DECODERT_OPENVINO_CONFIG`` (a JSON object) over the defaults: the thread
    count, and with ``exact`` (a float-weight artifact) ``INFERENCE_PRECISION_HINT`` f32, so that the prefill
    gives the tokens the ort backend gives (OpenVINO's own default on an AMX / AVX-512 BF16 CPU is bf16, which
    changed SmolLM2 fp32's greedy chat answer); a quantized artifact keeps OpenVINO's default."""
    props: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"} if exact else {}
    text = os.environ.get("DECODERT_OPENVINO_CONFIG", "")
    if text:
        try:
            props = {**props, **dict(json.loads(text))}
        except (ValueError, TypeError):
            raise DecodertError(f"DECODERT_OPENVINO_CONFIG must be a JSON object of OpenVINO CPU properties, got {text!r}") from None
    threads = threads or int(os.environ.get("DECODERT_THREADS", "0")) or None
    if threads:
        props.setdefault("INFERENCE_NUM_THREADS", int(threads))
    return props


class NativePrefill:
    """The prefill graph at ``path`` compiled by OpenVINO with its cache inputs' sequence axis free; with ``sdpa``
    its GroupQueryAttention nodes translated by runtime/backends/openvino/lowering.py instead of OpenVINO's frontend
    (placement's ``openvino-sdpa``)."""

    def __init__(self, path: Path, threads: int | None = None, exact: bool = False, sdpa: bool = False) -> None:
        import openvino as ov

        self._ov = ov
        lowering = None
        if sdpa:
            from decodert.runtime.backends.openvino.lowering import GqaToSdpa

            lowering = GqaToSdpa(half=str(properties(threads, exact).get("INFERENCE_PRECISION_HINT", "")).lower() != "f32")
        try:
            core = ov.Core()
            if lowering is not None:
                for extension in lowering.extensions():
                    core.add_extension(extension)
            model = core.read_model(str(path))
            shapes = {}
            for port in model.inputs:
                name = port.get_any_name()
                if name.startswith("past_") and name != "past_lengths":
                    dims = port.get_partial_shape()
                    shapes[name] = ov.PartialShape([-1, dims[1], -1, dims[3]])
            model.reshape(shapes)
            self.names = {p.get_any_name() for p in model.inputs}
            self.request = core.compile_model(model, "CPU", properties(threads, exact)).create_infer_request()
        except (RuntimeError, ValueError) as e:  # an op it cannot read, a shape it cannot take
            why = (lowering and lowering.refused) or first_line(e)
            raise DecodertError(f"{path}: OpenVINO cannot compile the graph ({why[:300]})") from None
        self.zero = np.zeros(1, np.int64)

    def run(self, cache: Any, slot: int, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` [n] to ``slot``'s K/V (the new rows copied into the cache); returns the logits [V]
        after the last one. The caller commits the ids."""
        ov, req = self._ov, self.request
        past, n = int(cache.lengths[slot]), len(ids)
        feeds = {"input_ids": np.ascontiguousarray(ids, np.int64).reshape(1, n),
                 "past_lengths": np.array([past], np.int64), "seq_lengths": np.array([n], np.int64)}
        if "per_position" in self.names:
            feeds["per_position"] = self.zero
        for name, arr in feeds.items():
            req.set_tensor(name, ov.Tensor(arr))
        names = _cache_names(cache)
        for i, name in enumerate(names):  # the rows the slot holds: [1, H_kv, past, D]
            req.set_tensor(f"past_{name}", ov.Tensor(np.ascontiguousarray(cache.buffers[i][slot : slot + 1, :, :past])))
        try:
            req.infer()
        except RuntimeError as e:
            raise DecodertError(f"OpenVINO failed running the prefill graph ({first_line(e)[:300]})") from None
        for i, name in enumerate(names):  # only the new rows go into the cache
            cache.buffers[i][slot, :, past : past + n] = req.get_tensor(f"present_{name}").data[0, :, past : past + n]
        return np.array(req.get_tensor("logits").data[0], np.float32)


def _cache_names(cache: Any) -> list[str]:
    """``key.3`` / ``value.3`` of each K/V buffer, in the cache's order (runtime/backends/ort/verify.py bind_cache)."""
    return [f"{('key', 'value')[i % 2]}.{cache.kv_layers[i // 2]}" for i in range(len(cache.buffers))]
