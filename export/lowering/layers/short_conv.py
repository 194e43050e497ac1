"""The "conv" layer kind's lowering (models/layers/short_conv.py), LFM2's gated short convolution over the
layer's rolling conv state, one recipe for every target:

    b, c, x = split(h @ conv_in^T)             [.., C] each
    y       = c * causal_conv(b * x)           depthwise, K taps, state = the last K-1 inputs [B, C, K-1]
    o       = y @ conv_out^T
"""

from __future__ import annotations

from typing import Any, Callable

from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.layers import ShortConvSpec
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def mixer(g: GraphBuilder, low: Lowering, ctx: Any, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
          linear: Callable[..., str]) -> str:
    """The gated short conv of layer ``i`` -> conv_out's output (its linears take no LoRA update)."""
    conv: ShortConvSpec = spec.mixer(i)
    p, c = f"layers.{i}.", spec.hidden_size
    bias = conv.bias
    with g.scope("conv"):
        with g.scope("in"):
            bcx = low.linear(g, h, p + "conv_in", p + "conv_in_bias" if bias else None)
        gate_b, gate_c, x = g.op("Split", bcx, g.const([c] * 3), axis=-1, outputs=3)
        bx = g.op("Mul", gate_b, x)
        bsc = g.op("Concat", g.op("Shape", inp.input_ids), g.const([c]), axis=0)  # [B, S, C]
        bcs = g.op("Transpose", g.op("Reshape", bx, bsc), perm=[0, 2, 1])  # [B, C, S]
        state = (f"past_conv.{i}", f"present_conv.{i}")
        y = low.causal_conv(g, bcs, p + "conv", p + "conv_bias" if bias else None, state, inp.seq_lengths, conv.kernel,
                            window=f"window_conv.{i}" if inp.windows else None)
        y = g.op("Transpose", y, perm=[0, 2, 1])  # [B, S, C]
        y = g.op("Mul", gate_c, g.op("Reshape", y, g.const([-1, c])) if low.flat_tokens else y)
        with g.scope("out"):
            return low.linear(g, y, p + "conv_out", p + "conv_out_bias" if bias else None)
