"""The "linear_attention" layer kind's lowering (models/layers/delta_net.py: Qwen3.5's Gated DeltaNet), one recipe
for every target.

    h [T or B,S, hidden]
      |  linear_in (one GEMM: in_proj_qkv | z | b | a rows)
      +-- mixed [.., 2Kd+Vd] --> causal_conv over the layer's conv state (K taps, silu)    [B,S,2Kd+Vd]
      |                              q [Kd], k [Kd], v [Vd]
      +-- z [.., Vd], b [.., Hv], a [.., Hv]
      |
      y    = gated_delta_net(q, k, v, a, b, a_log, dt_bias) over the recurrent state  [B,S,Vd]
             (plugins/ops/gated_delta_net.py: l2norm q/k, decay, beta, delta rule; float32 state)
      y    = rmsnorm(y per value head) * w * silu(z)          (the gated RMSNorm, plain w)
      o    = y @ linear_out^T                                 [.., hidden]
    Kd = Hk*Dk, Vd = Hv*Dv; both states are written in place (one buffer bound to past_* and present_*).
"""

from __future__ import annotations

from typing import Callable

from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import GraphBuilder


def single_token(g: GraphBuilder, inp: GraphInputs) -> bool:
    """Whether the graph's token count is statically 1 (the decode graph)."""
    for vi in g.inputs:
        if vi.name == inp.input_ids:
            dims = vi.type.tensor_type.shape.dim
            return len(dims) == 2 and dims[1].HasField("dim_value") and dims[1].dim_value == 1
    return False


def mixer(g: GraphBuilder, low: Lowering, ctx, inp: GraphInputs, spec: ModelSpec, i: int, h: str,
          linear: Callable[..., str]) -> str:
    """Gated DeltaNet over layer ``i``'s conv and recurrent states -> the out projection's output;
    ``linear(x, target)``: the layer's linears (graph.decoder_layer's, with each row's LoRA update)."""
    p, s = f"layers.{i}.", spec.mixer(i)
    hv, dv = s.value_heads, s.value_dim
    kd, vd = s.key_heads * s.key_dim, hv * dv
    channels = 2 * kd + vd
    with g.scope("linear_attn"):
        with g.scope("in"):
            proj = linear(h, "linear_in")
        mixed, z, b, a = g.op("Split", proj, g.const([channels, vd, hv, hv]), axis=-1, outputs=4)
        if low.flat_tokens:  # [T, n] -> [B, S, n]
            bs = g.op("Shape", inp.input_ids)
            mixed, b, a = (g.op("Reshape", x, g.op("Concat", bs, g.const([n]), axis=0))
                           for x, n in ((mixed, channels), (b, hv), (a, hv)))
        with g.scope("conv"):
            conv = low.causal_conv(g, g.op("Transpose", mixed, perm=[0, 2, 1]), p + "linear_conv", None,
                                   (f"past_conv.{i}", f"present_conv.{i}"), inp.seq_lengths, s.kernel,
                                   channels=channels, activation="silu")
            conv = g.op("Transpose", conv, perm=[0, 2, 1])  # [B, S, C]
        q, k, v = g.op("Split", conv, g.const([kd, kd, vd]), axis=-1, outputs=3)
        with g.scope("delta_rule"):
            y = low.gated_delta_net(g, (q, k, v, a, b), p + "linear_a_log", p + "linear_dt_bias",
                                    (f"past_recurrent.{i}", f"present_recurrent.{i}"), inp.seq_lengths, s,
                                    single=single_token(g, inp))
        with g.scope("gated_norm"):
            lead = [-1] if low.flat_tokens else [0, 0]
            heads = g.op("Reshape", y, g.const(lead + [hv, dv]))
            normed = low.rms_norm(g, heads, p + "linear_norm")
            z4 = g.op("Reshape", z, g.const(lead + [hv, dv]))
            gated = g.op("Reshape", g.op("Mul", normed, g.op("Mul", z4, g.op("Sigmoid", z4))), g.const(lead + [vd]))
        with g.scope("out"):
            return linear(gated, "linear_out")
