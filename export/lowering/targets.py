"""The export targets, one ``Target`` each: every decision that differs between targets lives here
(and in the lowering a target names, and in what the target promises the runtimes: artifact/targets.py,
one ``TargetInfo`` each), so no other module branches on a target's name.

    ort       ONNX Runtime contrib ops (GroupQueryAttention, MatMulNBits, SkipSimplifiedLayerNorm)
    trt       standard ONNX TensorRT parses (Attention, TensorScatter, RMSNormalization; decodert
              plugin nodes for a TensorRT without those layers); int4/int8 weights symmetric
    portable  standard ONNX ops only, decomposed attention: any ONNX runtime

docs/ARCHITECTURE.md ("How to add a target") walks through adding one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from decodert.artifact.targets import TargetInfo, target_info
from decodert.errors import DecodertError
from decodert.export.lowering.lower_ort import OrtLowering
from decodert.export.lowering.lower_trt import TrtLowering
from decodert.export.lowering.lowering import Lowering
from decodert.export.quantize.quant import QuantConfig, WeightQuant
from decodert.export.quantize.weight_layouts import WeightLayout
from decodert.models.spec import ModelSpec
from decodert.plugins.ops.kv_dtypes import KVDtype
from decodert.plugins.selection import NATIVE_SINCE


@dataclass(frozen=True)
class Target:
    info: TargetInfo  # name, the backends that run its graphs, what a step may ask of them (artifact/targets.py)
    lowering: type[Lowering]  # attention, norm and matmul lowering; the graphs' opsets
    symmetric_weights: bool = False  # quantized weights without zero points (TensorRT's int4/int8)
    plugin_nodes: bool = False  # may emit decodert plugin nodes (--plugins, --trt-version)
    tensorrt_native_since: tuple[int, ...] | None = None  # TensorRT with the native layers; older needs plugins
    lora_inputs: bool = True  # graphs may take LoRA adapter slots (--lora-slots); --merge-lora works everywhere
    encoder_decoder: bool = False  # exports encoder-decoder models (Whisper: export/seq2seq_export.py)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def weight_layout(self) -> WeightLayout:
        return self.lowering.quant_layout

    def quant_config(self, quant: QuantConfig | None) -> QuantConfig | None:
        """``quant`` as this target can store it (TensorRT: symmetric), or a one-line error."""
        if quant is None:
            return None
        if quant.keep_q4_1 and not self.weight_layout.block_minimum:
            raise DecodertError(f"--keep-q4-1 works on the ort target only (its per-block minimum needs MatMulNBits), "
                                f"not --target {self.name}; drop --keep-q4-1 or use --target ort")
        return replace(quant, symmetric=True) if self.symmetric_weights and not quant.symmetric else quant

    def make_lowering(self, spec: ModelSpec, dtype: str, max_seq: int, quant: QuantConfig | None = None,
                      quantized: Mapping[str, WeightQuant] | None = None, plugins: tuple[str, ...] = (),
                      kv: KVDtype | None = None) -> Lowering:
        """``plugins``: decodert ops to emit as plugin nodes (only a target with ``plugin_nodes``);
        ``kv``: the cache's element type (default: ``dtype``), or a one-line error where it cannot be kept."""
        if plugins:
            if not self.plugin_nodes:
                raise DecodertError(f"--target {self.name} cannot emit decodert plugin nodes")
            low: Lowering = TrtLowering(spec, dtype, max_seq, quant, quantized, kv, plugins=plugins)
        else:
            low = self.lowering(spec, dtype, max_seq, quant, quantized, kv)
        problem = low.kv_problem()
        if problem:
            raise DecodertError(f"--kv-dtype {low.kv.name} on --target {self.name}: {problem}")
        return low

    def check_quantized_head(self) -> None:
        """A one-line error where a draft head's quantized linears (MatMulNBits, export/heads/own_kv.py) would not
        run beside this target's graphs."""
        if self.weight_layout.name != "nbits":
            raise DecodertError(f"a quantized head runs on the ort target only (MatMulNBits); this target is {self.name}")

    def check_lora_slots(self, slots: int) -> None:
        """A one-line error when ``--lora-slots`` asks this target for adapter inputs it does not take."""
        if slots and not self.lora_inputs:
            raise DecodertError(f"--lora-slots: --target {self.name} graphs take no LoRA adapters at run time; "
                                "merge one with --merge-lora, or export --target ort or portable")


ORT = Target(target_info("ort"), OrtLowering, encoder_decoder=True)
TRT = Target(target_info("trt"), TrtLowering, symmetric_weights=True, plugin_nodes=True,
             tensorrt_native_since=NATIVE_SINCE, lora_inputs=False,  # the TensorRT backend binds no adapter slots
             encoder_decoder=True)
PORTABLE = Target(target_info("portable"), Lowering)
TARGETS: dict[str, Target] = {t.name: t for t in (ORT, TRT, PORTABLE)}


def get_target(name: str) -> Target:
    return TARGETS[target_info(name).name]  # an unknown name: target_info's one-line error
