"""Per-phase graphs: a second prefill graph lowered for another backend than the target's, written beside
the target's graphs and recorded in ``manifest.phase_graphs`` (artifact/manifest.py ``PhaseGraphRecord``).

``--openvino-prefill`` (ort target): ``prefill.portable.onnx``, the portable lowering of the prefill
(standard ONNX ops), which the OpenVINO execution provider takes whole, where the ort target's
com.microsoft ops make it refuse the graph (runtime/backends/openvino/ep.py). The runtime's placement
(runtime/backends/placement.py) measures it against the target's prefill and keeps the faster one.

Weights: a float export's portable graph reads the target's ``weights.bin`` (the same canonical tensors,
nothing more on disk). A quantized one needs the qdq layout (DequantizeLinear [N, Kp]) and, for a tied
head, the float embedding the nbits layout does without, so it gets its own ``weights.portable.bin``
(SmolLM2-135M int4: 92 MB ort artifact + 196 MB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import onnx

from decodert.errors import DecodertError
from decodert.artifact.lora_layout import LoraLayout
from decodert.artifact.manifest import GraphRecord, PhaseGraphRecord, from_json
from decodert.export.lowering.graph import build_graph
from decodert.export.lowering.io_contract import io_contract, verifies_rows
from decodert.export.lowering.targets import get_target
from decodert.export.quantize.quant import QuantConfig
from decodert.models.spec import ModelSpec
from decodert.plugins.ops.kv_dtypes import KVDtype

LOWERING = "portable"
FILE = "prefill.portable.onnx"
WEIGHTS = "weights.portable.bin"


def check_openvino_prefill(target: str, kv: KVDtype, lora: LoraLayout | None, quant: QuantConfig | None) -> None:
    """A one-line error where ``--openvino-prefill`` cannot give the same model as the target's prefill."""
    info = get_target(target).info
    if not info.portable_prefill_beside:
        raise DecodertError(f"--openvino-prefill adds a portable prefill graph to --target ort artifacts; a --target "
                            f"{target} artifact's prefill.onnx is {'already portable' if info.standard_ops else 'for TensorRT'}")
    if kv.quantized:
        raise DecodertError(f"--openvino-prefill takes a float KV cache (--kv-dtype {kv.name} keeps calibrated scales "
                            "the portable prefill does not read)")
    if lora is not None:
        raise DecodertError("--openvino-prefill does not take --lora-slots (the adapters' inputs run on the ort graphs only)")
    if quant is not None:
        get_target(LOWERING).quant_config(quant)  # --keep-q4-1: its block minimums need MatMulNBits


def write_portable_prefill(spec: ModelSpec, dtype: str, max_seq: int, quant: QuantConfig | None, weights: dict,
                           kv: KVDtype, tmp: Path, weights_file: str,
                           write_weights: Callable[[Path, Any], tuple[dict, dict]]) -> dict[str, PhaseGraphRecord]:
    """``prefill.portable.onnx`` (and, quantized, its weights) in ``tmp`` -> manifest.phase_graphs.
    ``write_weights(path, layout)`` streams the checkpoint's tensors into ``path`` in ``layout``."""
    portable = get_target(LOWERING)
    if quant is None:
        own, quantized, file = weights, {}, weights_file
    else:
        own, quantized = write_weights(tmp / WEIGHTS, portable.weight_layout)
        file = WEIGHTS
    lowering = portable.make_lowering(spec, dtype, max_seq, portable.quant_config(quant), quantized, kv=kv)
    path = tmp / FILE
    onnx.save_model(build_graph(spec, lowering, own, "prefill"), path)
    onnx.checker.check_model(str(path), full_check=True)
    contract = {"file": FILE, **io_contract(spec, dtype, max_seq, "prefill", verifies_rows(lowering, "prefill"), kv, None)}
    graph = from_json(GraphRecord, contract, f"phase_graphs.prefill.{LOWERING}.graph")
    return {f"prefill.{LOWERING}": PhaseGraphRecord(phase="prefill", lowering=LOWERING, graph=graph, weights=file)}
