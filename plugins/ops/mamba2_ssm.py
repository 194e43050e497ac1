"""Mamba2SSM: the selective state-space recurrence of a Mamba2 layer (Nemotron-H, Granite 4.0-H).

    x [B,S,H*Dh]  dt [B,S,H]  b,c [B,S,G*N]  a_log,dt_bias,d [H] f32  past_state [B,H,N,Dh] f32
        dt    = softplus(dt + dt_bias)                    [B,S,H]  (0 on a padded token)
        decay = exp(-exp(a_log) * dt)                     a scalar per head and token
        (group g of b/c serves heads g*H/G .. (g+1)*H/G-1)
        per token t, per head (S_t [N, Dh]):
            S    = decay_t S_{t-1} + b_t (dt_t x_t)^T     (an outer product: key b, value dt x)
            y_t  = S^T c_t + d x_t                        [Dh]  (the D skip)
        present_state = S after the row's last valid token     y [B,S,H*Dh]

This is ONNX Runtime's ``LinearAttention`` with ``update_rule="gated"`` (query c, key b, value dt x,
log decay -exp(a_log) dt, scale 1), whose state layout [B, H, d_k = N, d_v = Dh] it keeps; transformers'
``mamba2_selective_state_update`` / ``mamba2_chunk_scan`` (modeling_nemotron_h.py, the torch path) keep
the transpose [B, H, Dh, N]. The default dt limits (0, inf) clamp nothing, so no clamp is applied. A padded
token (t >= seq_lengths[b]) gets dt = 0: decay 1 and a zero update, so S passes it unchanged. The state
is float32 whatever T is.

Reference body: one token (the decode graph) is two MatMuls; several tokens run a ``Loop`` over the tokens
with the state carried (plugins/ops/gated_delta_net.py ``token_loop``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from decodert.plugins.ops.gated_delta_net import token_loop, valid_tokens
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.registry import OpDef, register


# ---- numpy reference -----------------------------------------------------------------------
def mamba2_ssm_ref(x, dt, b, c, a_log, dt_bias, d, past_state, seq_lengths=None, **_):
    """Returns (y [B,S,H*Dh] in x's dtype, present_state [B,H,N,Dh] float32); inputs unchanged."""
    b_, s_ = x.shape[:2]
    h, n, dh = past_state.shape[1:]
    groups = b.shape[-1] // n
    xf = x.astype(np.float32).reshape(b_, s_, h, dh)
    bf = np.repeat(b.astype(np.float32).reshape(b_, s_, groups, n), h // groups, axis=2)  # [B,S,H,N]
    cf = np.repeat(c.astype(np.float32).reshape(b_, s_, groups, n), h // groups, axis=2)
    step = np.logaddexp(0.0, dt.astype(np.float32) + dt_bias.astype(np.float32)).astype(np.float32)  # [B,S,H]
    if seq_lengths is not None:
        step = np.where(np.arange(s_)[None, :, None] < np.asarray(seq_lengths)[:, None, None], step, 0.0)
    decay = np.exp(-np.exp(a_log.astype(np.float32)) * step)
    state = past_state.astype(np.float32).copy()
    y = np.zeros((b_, s_, h, dh), np.float32)
    for t in range(s_):
        state = state * decay[:, t, :, None, None] + np.einsum("bhn,bhd->bhnd", bf[:, t], xf[:, t] * step[:, t, :, None])
        y[:, t] = np.einsum("bhnd,bhn->bhd", state, cf[:, t]) + xf[:, t] * d.astype(np.float32)[:, None]
    return y.reshape(b_, s_, h * dh).astype(x.dtype), state


# ---- reference body (standard ONNX ops, opset >= 18) ---------------------------------------
def gates(g: GraphBuilder, x: str, dt: str, a_log: str, dt_bias: str, seq_lengths: str, *, heads: int,
          head_dim: int) -> tuple[str, str, str]:
    """float32 (x [B,S,H,Dh], dt x [B,S,H,Dh], log decay -exp(a_log) dt [B,S,H]); dt = 0 on padded tokens."""
    step = g.op("Softplus", g.op("Add", dt, dt_bias))  # [B,S,H]
    if seq_lengths:
        step = g.op("Where", valid_tokens(g, dt, seq_lengths), step, g.const(np.float32(0.0)))
    x4 = g.op("Reshape", x, g.const([0, 0, heads, head_dim]))
    value = g.op("Mul", x4, g.op("Unsqueeze", step, g.const([3])))
    return x4, value, g.op("Mul", g.op("Neg", g.op("Exp", a_log)), step)


def per_head(g: GraphBuilder, bc: str, *, heads: int, groups: int, state: int) -> str:
    """b or c [B,S,G*N] -> [B,S,H,N] (each group's rows repeated for its H/G heads)."""
    x = g.op("Reshape", bc, g.const([0, 0, groups, 1, state]))
    x = g.op("Expand", x, g.const([1, 1, 1, heads // groups, 1]))
    return g.op("Reshape", x, g.const([0, 0, heads, state]))


def step(g: GraphBuilder, state: str, key: str, value: str, query: str, decay: str) -> tuple[str, str]:
    """One token: state [B,H,N,Dh]; key, query [B,H,N]; value [B,H,Dh]; decay [B,H] -> (state, y [B,H,Dh])."""
    s = g.op("Mul", state, g.op("Unsqueeze", decay, g.const([2, 3])))
    s = g.op("Add", s, g.op("MatMul", g.op("Unsqueeze", key, g.const([3])), g.op("Unsqueeze", value, g.const([2]))))
    y = g.op("Squeeze", g.op("MatMul", g.op("Unsqueeze", query, g.const([2])), s), g.const([2]))  # [B,H,1,Dh] -> [B,H,Dh]
    return s, y


def mamba2_ssm_body(g: GraphBuilder, x: str, dt: str, b: str, c: str, a_log: str, dt_bias: str, d: str,
                    past_state: str, seq_lengths: str, present: str, *, heads: int, head_dim: int, groups: int,
                    state: int, dtype: str, single: bool, out: str | None = None) -> str:
    """The whole op in standard ops -> y [B,S,H*Dh] (T); writes ``present``. a_log, dt_bias, d float32."""
    f = (lambda v: g.op("Cast", v, to=TensorProto.FLOAT)) if dtype != "fp32" else (lambda v: v)  # noqa: E731
    x4, value, log_decay = gates(g, f(x), f(dt), a_log, dt_bias, seq_lengths, heads=heads, head_dim=head_dim)
    key, query = (per_head(g, f(v), heads=heads, groups=groups, state=state) for v in (b, c))
    tokens = lambda v: g.op("Transpose", v, perm=[1, 0, 2, 3])  # noqa: E731  [B,S,H,n] -> [S,B,H,n]
    decay = g.op("Transpose", g.op("Exp", log_decay), perm=[1, 0, 2])
    ys = token_loop(g, (tokens(key), tokens(value), tokens(query), decay), past_state, present, step, single=single,
                    name="mamba2_step")
    y = g.op("Add", g.op("Transpose", ys, perm=[1, 0, 2, 3]), g.op("Mul", x4, g.op("Unsqueeze", d, g.const([1]))))
    y = g.op("Reshape", y, g.const([0, 0, heads * head_dim]))
    if dtype != "fp32":
        y = g.op("Cast", y, to=DTYPES[dtype])
    return g.op("Identity", y, outputs=[out])[0]


# ---- the op: shape rule, expansion body, registration --------------------------------------
def mamba2_ssm_shapes(ins: list, attrs: dict, const) -> list:
    """y = x's shape; present_state = past_state's shape."""
    return [list(ins[0]), list(ins[7])]


def mamba2_ssm_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    x, dt, b, c, a_log, dt_bias, d, past_state = inputs[:8]
    seq_lengths = inputs[8] if len(inputs) > 8 else ""
    heads, state, head_dim = (ctx.static_dim(past_state, i) for i in (1, 2, 3))
    width = ctx.static_dim(b, 2)
    if width % state or heads % (width // state) or ctx.static_dim(x, 2) != heads * head_dim:
        raise ctx.error(f"b/c width {width} must be groups x {state} dividing {heads} heads, x width {heads * head_dim}")
    try:
        single = ctx.static_dim(x, 1) == 1
    except Exception:  # noqa: BLE001 - a dynamic token count runs the Loop
        single = False
    mamba2_ssm_body(g, x, dt, b, c, a_log, dt_bias, d, past_state, seq_lengths, outputs[1], heads=heads,
                    head_dim=head_dim, groups=width // state, state=state, dtype=ctx.dtype(x), single=single,
                    out=outputs[0])


MAMBA2_SSM = register(
    OpDef(
        name="Mamba2SSM",
        inputs=("x: T [B,S,H*Dh]", "dt: T [B,S,H]", "b: T [B,S,G*N]", "c: T [B,S,G*N]", "a_log: float [H]",
                "dt_bias: float [H]", "d: float [H]", "past_state: float [B,H,N,Dh]",
                "seq_lengths: int64 [B] (optional)"),
        outputs=("y: T [B,S,H*Dh]", "present_state: float [B,H,N,Dh] (aliases past_state)"),
        attributes={},
        numpy_ref=mamba2_ssm_ref,
        shape_rule=mamba2_ssm_shapes,
        body=mamba2_ssm_expand,
        min_outputs=2,
        aliases={1: 7},
        doc=__doc__ or "",
    )
)
