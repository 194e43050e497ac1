"""The "mamba2" layer kind's lowering (models/layers/mamba2.py: Nemotron-H, Granite 4.0-H), one recipe for every
target.

    h [T or B,S, hidden]
      |  mamba_in (one GEMM: z | x, B, C | dt rows)
      +-- z [.., Di]
      +-- xBC [.., Di + 2GN] --> causal_conv over the layer's conv state (K taps, + bias, silu)   [B,S,Di+2GN]
      |                              x [Di], B [GN], C [GN]
      +-- dt [.., H]
      |
      y    = mamba2_ssm(x, dt, B, C; a_log, dt_bias, D) over the recurrent state [B,H,N,Dh]   [B,S,Di]
             (plugins/ops/mamba2_ssm.py: dt = softplus(dt + dt_bias), decay exp(-exp(a_log) dt), D skip)
      y    = grouped_rmsnorm(y * silu(z)) * w                 G groups of Di/G (gate before the norm)
      o    = y @ mamba_out^T                                  [.., hidden]
    Di = H*Dh; both states are written in place (one buffer bound to past_* and present_*).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from decodert.export.lowering.layers.delta_net import single_token
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.layers import Mamba2Spec
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder


def mixer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
          linear: Callable[..., str]) -> str:
    """Mamba2 over layer ``i``'s conv and recurrent states -> the out projection's output;
    ``linear(x, target)``: the layer's linears (graph.decoder_layer's, with each row's LoRA update)."""
    p, s = f"layers.{i}.", spec.mixer(i)
    di, heads, gn = s.inner, s.heads, s.groups * s.state
    channels = s.conv_channels
    with g.scope("mamba"):
        with g.scope("in"):
            proj = linear(h, "mamba_in")
        z, xbc, dt = g.op("Split", proj, g.const([di, channels, heads]), axis=-1, outputs=3)
        if low.flat_tokens:  # [T, n] -> [B, S, n]
            bs = g.op("Shape", inp.input_ids)
            xbc, dt = (g.op("Reshape", v, g.op("Concat", bs, g.const([n]), axis=0)) for v, n in ((xbc, channels), (dt, heads)))
        with g.scope("conv"):
            conv = low.causal_conv(g, g.op("Transpose", xbc, perm=[0, 2, 1]), p + "mamba_conv",
                                   p + "mamba_conv_bias" if s.conv_bias else None,
                                   (f"past_conv.{i}", f"present_conv.{i}"), inp.seq_lengths, s.kernel,
                                   channels=channels, activation="silu")
            conv = g.op("Transpose", conv, perm=[0, 2, 1])  # [B, S, C]
        x, b, c = g.op("Split", conv, g.const([di, gn, gn]), axis=-1, outputs=3)
        with g.scope("ssm"):
            y = low.mamba2_ssm(g, (x, dt, b, c), p, (f"past_recurrent.{i}", f"present_recurrent.{i}"), inp.seq_lengths,
                               s, single=single_token(g, inp))
        with g.scope("gated_norm"):
            if low.flat_tokens:
                y = g.op("Reshape", y, g.const([-1, di]))
            gated = _gated_norm(g, low, spec, s, y, z, p + "mamba_norm")
        with g.scope("out"):
            return linear(gated, "mamba_out")


def _gated_norm(g: GraphBuilder, low: Lowering, spec: ModelSpec, s: Mamba2Spec, y: str, z: str, weight: str) -> str:
    """rmsnorm over each of the G groups of (y * silu(z)), in float32, then * w (transformers'
    NemotronHRMSNormGated: the gate before the norm, groups of Di/G, the weight after the cast back)."""
    f = (lambda v: g.op("Cast", v, to=1)) if low.dtype != "fp32" else (lambda v: v)  # noqa: E731
    yf, zf = f(y), f(z)
    gated = g.op("Mul", yf, g.op("Mul", zf, g.op("Sigmoid", zf)))
    groups = g.op("Reshape", gated, g.const([0] * (1 if low.flat_tokens else 2) + [s.groups, -1]))
    ms = g.op("ReduceMean", g.op("Mul", groups, groups), g.const([-1]), keepdims=1)
    normed = g.op("Mul", groups, g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(np.float32(spec.rms_norm_eps))))))
    normed = g.op("Reshape", normed, g.op("Shape", gated))
    if low.dtype != "fp32":
        normed = g.op("Cast", normed, to=DTYPES[low.dtype])
    return g.op("Mul", normed, weight)
