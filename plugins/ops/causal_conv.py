"""CausalConv: causal depthwise 1-D convolution over the tokens, with a rolling state, defined once.

    x [B,S,C]   past_state [B,C,K-1]   weight [C,K]   seq_lengths [B] (valid tokens per row)
         \\            |
          +-- full = concat(past_state, x^T) along time          [B, C, K-1+S]
                       |
          y[b,t,c]   = act(bias[c] + sum_j weight[c,j] * full[b,c,t+j])       [B,S,C]
          present[b] = full[b, :, n_b .. n_b+K-2]   (n_b = seq_lengths[b])    [B,C,K-1]

The state is the last K-1 inputs of the row's *valid* tokens, so a right-padded row's state is
what its single run would leave (its padded outputs are garbage nobody reads). ``activation`` is
"none" or "silu". This is transformers' ``causal_conv1d_update`` / ``causal_conv1d_fn`` with
state (Qwen3.5's Gated DeltaNet, before q/k/v split) and LFM2's short convolution.
"""

from __future__ import annotations

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder
from decodert.plugins.registry import OpDef, register

ACTIVATIONS = ("none", "silu")


# ---- numpy reference -----------------------------------------------------------------------
def causal_conv_ref(x, weight, past_state, seq_lengths=None, bias=None, *, activation="none"):
    """Returns (y [B,S,C] in x's dtype, present_state [B,C,K-1]); inputs are not modified."""
    b_, s_, c_ = x.shape
    k_ = weight.shape[1]
    full = np.concatenate([past_state.astype(np.float32), x.astype(np.float32).transpose(0, 2, 1)], axis=2)
    w = weight.astype(np.float32)
    y = np.zeros((b_, c_, s_), np.float32)
    for j in range(k_):
        y += w[None, :, j : j + 1] * full[:, :, j : j + s_]
    if bias is not None:
        y += bias.astype(np.float32)[None, :, None]
    if activation == "silu":
        y = y / (1.0 + np.exp(-y))
    lengths = np.full(b_, s_) if seq_lengths is None else np.asarray(seq_lengths)
    present = np.stack([full[b, :, int(n) : int(n) + k_ - 1] for b, n in enumerate(lengths)])
    return y.transpose(0, 2, 1).astype(x.dtype), present.astype(past_state.dtype)


# ---- reference body (standard ONNX ops, opset >= 18) ---------------------------------------
def full_window(g: GraphBuilder, x_bcs: str, past_state: str) -> str:
    """concat(past [B,C,K-1], x [B,C,S]) -> [B,C,K-1+S]: the only reader of the past state."""
    return g.op("Concat", past_state, x_bcs, axis=2)


def next_state(g: GraphBuilder, full: str, seq_lengths: str, kernel: int, out: str | None = None) -> str:
    """full[b, :, n_b .. n_b+K-2] for each row -> [B,C,K-1] (GatherElements on the time axis)."""
    steps = g.const(np.arange(kernel - 1, dtype=np.int64).reshape(1, 1, kernel - 1))
    idx = g.op("Add", g.op("Unsqueeze", seq_lengths, g.const([1, 2])), steps)  # [B,1,K-1]
    shape = g.op("Concat", g.op("Shape", full, end=2), g.const([kernel - 1]), axis=0)
    return g.op("GatherElements", full, g.op("Expand", idx, shape), axis=2, outputs=[out])[0]


def conv_body(g: GraphBuilder, full: str, weight: str, bias: str, *, kernel: int, channels: int,
              activation: str) -> str:
    """Depthwise Conv (group = C, no padding) over the window -> y [B,C,S]."""
    w = g.op("Reshape", weight, g.const([channels, 1, kernel]))
    y = g.op("Conv", full, w, *([bias] if bias else []), group=channels, kernel_shape=[kernel])
    if activation == "silu":
        y = g.op("Mul", y, g.op("Sigmoid", y))
    return y


def seq_lengths_or_full(g: GraphBuilder, x: str, seq_lengths: str) -> str:
    """The row lengths, or S for every row when the input is absent."""
    if seq_lengths:
        return seq_lengths
    return g.op("Expand", g.op("Shape", x, start=1, end=2), g.op("Shape", x, end=1))


def causal_conv_shapes(ins: list, attrs: dict, const) -> list:
    """y = x's shape; present_state = past_state's."""
    return [list(ins[0]), list(ins[2])]


def causal_conv_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    x, weight, past_state = inputs[:3]
    seq_lengths = inputs[3] if len(inputs) > 3 else ""
    bias = inputs[4] if len(inputs) > 4 else ""
    channels, kernel = ctx.static_dim(weight, 0), ctx.static_dim(weight, 1)
    if attrs["activation"] not in ACTIVATIONS:
        raise ctx.error(f"activation '{attrs['activation']}' is not one of {', '.join(ACTIVATIONS)}")
    full = full_window(g, g.op("Transpose", x, perm=[0, 2, 1]), past_state)
    y = conv_body(g, full, weight, bias, kernel=kernel, channels=channels, activation=attrs["activation"])
    g.op("Transpose", y, perm=[0, 2, 1], outputs=[outputs[0]])
    next_state(g, full, seq_lengths_or_full(g, x, seq_lengths), kernel, outputs[1])


CAUSAL_CONV = register(
    OpDef(
        name="CausalConv",
        inputs=("x: T [B,S,C]", "weight: T [C,K]", "past_state: T [B,C,K-1]",
                "seq_lengths: int64 [B] (optional)", "bias: T [C] (optional)"),
        outputs=("y: T [B,S,C]", "present_state: T [B,C,K-1] (aliases past_state)"),
        attributes={"activation": "none"},
        numpy_ref=causal_conv_ref,
        shape_rule=causal_conv_shapes,
        body=causal_conv_expand,
        min_outputs=2,
        aliases={1: 2},
        doc=__doc__ or "",
    )
)
