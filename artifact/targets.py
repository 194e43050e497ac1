"""What an artifact's target (manifest ``target``) promises the runtimes that open it: which backends run its
graphs, and how many rows a multi-token step over a non-empty cache may hold. How each target's graphs are
made is export/lowering/targets.py, whose ``Target`` pairs one of these descriptions with its lowering.

    ort       runs on ONNX Runtime only (contrib ops); a multi-token step with a cache at batch 1
    trt       runs on TensorRT (after `decodert build`) and ONNX Runtime
    portable  standard ONNX ops only: any ONNX runtime
"""

from __future__ import annotations

from dataclasses import dataclass

from decodert.errors import DecodertError


@dataclass(frozen=True)
class TargetInfo:
    name: str
    backends: tuple[str, ...]  # runtime backends that can run its graphs (trt: after `decodert build`)
    multi_token_rows: int | None = None  # rows a multi-token step over a non-empty cache may have (None: any)
    about: str = ""
    standard_ops: bool = False  # its graphs use standard ONNX ops only: OpenVINO's execution provider takes its prefill whole
    openvino_reads_prefill: bool = False  # OpenVINO's own runtime reads its prefill graph (placement's openvino-native)
    portable_prefill_beside: bool = False  # its export may add a portable prefill graph beside its own (--openvino-prefill)
    native_reads_decode: bool = False  # decodert's own CPU decode step reads its decode graph's weights (placement's native-cpu)

    def runs_on(self, backend: str) -> bool:
        return backend in self.backends


TARGET_INFOS: dict[str, TargetInfo] = {t.name: t for t in (
    TargetInfo("ort", ("ort",), multi_token_rows=1, about="ONNX Runtime contrib ops",
               openvino_reads_prefill=True, portable_prefill_beside=True, native_reads_decode=True),  # GroupQueryAttention: batch 1 with a cache
    TargetInfo("trt", ("trt", "ort"), about="standard ONNX TensorRT parses"),
    TargetInfo("portable", ("ort", "trt"), about="standard ONNX ops only", standard_ops=True),
)}


def target_info(name: str) -> TargetInfo:
    if name not in TARGET_INFOS:
        raise DecodertError(f"unknown target '{name}'; choose one of: {', '.join(TARGET_INFOS)}")
    return TARGET_INFOS[name]
