"""Weight-stripped engines (``decodert build`` without --self-contained): put the weights back at load.

An engine built with STRIP_PLAN + REFIT_IDENTICAL holds the kernels but not the weights; the
weights stay once in the artifact's weights.bin, the external data of the ONNX graph the engine
was built from. ``refit_from_onnx`` reads that graph with TensorRT's ONNX parser refitter
(``OnnxParserRefitter.refit_from_file``; the external data resolves next to the graph) and
applies it (``Refitter.refit_cuda_engine``) before any execution context is created.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from decodert.errors import DecodertError


def refit_from_onnx(trt: ModuleType, engine: Any, onnx_path: Path, logger: Any, where: Path) -> None:
    """Refit a deserialized weight-stripped ``engine`` from ``onnx_path``; DecodertError names what failed."""
    if not hasattr(trt, "OnnxParserRefitter"):
        raise DecodertError(f"{where}: the engine is weight-stripped but this TensorRT has no OnnxParserRefitter; "
                            f"rebuild it with `decodert build --self-contained`")
    if not onnx_path.is_file():
        raise DecodertError(f"{where}: the engine is weight-stripped and its graph {onnx_path.name} is missing")
    refitter = trt.Refitter(engine, logger)
    parser = trt.OnnxParserRefitter(refitter, logger)
    if not parser.refit_from_file(str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        listed = "; ".join(str(e.desc()) for e in errors) or "no error reported"
        raise DecodertError(f"{where}: refitting the weights from {onnx_path.name} failed: {listed}")
    if not refitter.refit_cuda_engine():
        missing = list(refitter.get_missing_weights())
        raise DecodertError(f"{where}: TensorRT refused the refit from {onnx_path.name}"
                            + (f" ({len(missing)} weights missing, e.g. {missing[0]})" if missing else "")
                            + "; rebuild the engines (`decodert build`)")
