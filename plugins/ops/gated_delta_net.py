"""GatedDeltaNet: the gated delta rule over a recurrent state (Qwen3.5 / Qwen3-Next linear attention).

    q,k [B,S,Hk*Dk]  v [B,S,Hv*Dv]  a,b [B,S,Hv]  a_log,dt_bias [Hv] f32  past_state [B,Hv,Dv,Dk] f32
        |                   |
    l2norm(q), l2norm(k)    g    = -exp(a_log) * softplus(a + dt_bias)   (log decay, <= 0)
    q *= scale              beta = sigmoid(b)
    (each q/k head serves Hv/Hk consecutive value heads)
        per token t, per value head (S_t [Dv,Dk], V-major as ONNX Runtime keeps it):
            S    = exp(g_t) S_{t-1}
            S   += (beta_t (v_t - S k_t)) k_t^T          (the delta rule: correct what S predicts for k_t)
            y_t  = S q_t                                  [Dv]
        present_state = S after the row's last valid token     y [B,S,Hv*Dv]

A padded token (t >= seq_lengths[b]) gets g = 0 and beta = 0: S is unchanged by it, so a
right-padded row's state is what its single run would leave. The state is float32 whatever T is
(the recurrence is where reduced precision hurts most). This is transformers'
``torch_recurrent_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=True`` (its chunked form
computes the same); the gates are the layer's (``Qwen3_5GatedDeltaNet.forward``).

Reference body: one token (the decode graph) is a few MatMuls; several tokens run a ``Loop`` over
the tokens with the state carried.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from onnx import TensorProto, helper

from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.plugins.registry import OpDef, register

L2_EPS = 1e-6  # transformers' l2norm (the FLA library's)
STATE_DIMS = ["batch", "value_heads", "value_dim", "key_dim"]


# ---- numpy reference -----------------------------------------------------------------------
def l2norm_ref(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + L2_EPS)


def gates_ref(a, b, a_log, dt_bias):
    """(g, beta) [B,S,Hv] float32 from the raw projections."""
    g = -np.exp(a_log.astype(np.float32)) * np.logaddexp(0.0, a.astype(np.float32) + dt_bias.astype(np.float32))
    return g.astype(np.float32), (1.0 / (1.0 + np.exp(-b.astype(np.float32)))).astype(np.float32)


def gated_delta_net_ref(q, k, v, a, b, a_log, dt_bias, past_state, seq_lengths=None, *, scale=0.0, **_):
    """Returns (y [B,S,Hv*Dv] in q's dtype, present_state [B,Hv,Dv,Dk] float32); inputs unchanged."""
    b_, s_ = q.shape[:2]
    hv, dv, dk = past_state.shape[1:]
    hk = q.shape[-1] // dk
    qf = l2norm_ref(q.astype(np.float32).reshape(b_, s_, hk, dk)) * (scale or dk ** -0.5)
    kf = l2norm_ref(k.astype(np.float32).reshape(b_, s_, hk, dk))
    qf, kf = np.repeat(qf, hv // hk, axis=2), np.repeat(kf, hv // hk, axis=2)  # [B,S,Hv,Dk]
    vf = v.astype(np.float32).reshape(b_, s_, hv, dv)
    g, beta = gates_ref(a, b, a_log, dt_bias)
    if seq_lengths is not None:
        valid = np.arange(s_)[None] < np.asarray(seq_lengths)[:, None]
        g, beta = np.where(valid[..., None], g, 0.0), np.where(valid[..., None], beta, 0.0)
    state = past_state.astype(np.float32).copy()
    y = np.zeros((b_, s_, hv, dv), np.float32)
    for t in range(s_):
        state *= np.exp(g[:, t])[:, :, None, None]
        delta = (vf[:, t] - np.einsum("bhvk,bhk->bhv", state, kf[:, t])) * beta[:, t][:, :, None]
        state += np.einsum("bhv,bhk->bhvk", delta, kf[:, t])
        y[:, t] = np.einsum("bhvk,bhk->bhv", state, qf[:, t])
    return y.reshape(b_, s_, hv * dv).astype(q.dtype), state


# ---- reference body (standard ONNX ops, opset >= 18) ---------------------------------------
def l2norm_body(g: GraphBuilder, x: str, dtype: type = np.float32) -> str:
    """x * 1/sqrt(sum(x^2, last axis) + 1e-6); ``dtype``: x's numpy type."""
    sums = g.op("ReduceSum", g.op("Mul", x, x), g.const([-1]), keepdims=1)
    return g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", sums, g.const(np.array(L2_EPS, dtype))))))


def valid_tokens(g: GraphBuilder, x: str, seq_lengths: str) -> str:
    """[B,S,1] bool: token s of row b is valid (s < seq_lengths[b]); x [B,S,...]."""
    steps = g.op("Range", g.const(np.int64(0)), g.op("Squeeze", g.op("Shape", x, start=1, end=2), g.const([0])),
                 g.const(np.int64(1)))
    valid = g.op("Less", g.op("Unsqueeze", steps, g.const([0])), g.op("Unsqueeze", seq_lengths, g.const([1])))
    return g.op("Unsqueeze", valid, g.const([2]))


def prepare(g: GraphBuilder, q: str, k: str, v: str, a: str, b: str, a_log: str, dt_bias: str, seq_lengths: str,
            *, hk: int, hv: int, dk: int, dv: int, scale: float, dtype: str):
    """float32 token-major operands: q,k [S,B,Hv,Dk] (normed, q scaled, heads repeated), v [S,B,Hv,Dv],
    decay = exp(g) and beta [S,B,Hv] (1 and 0 on padded tokens)."""
    f = (lambda x: g.op("Cast", x, to=TensorProto.FLOAT)) if dtype != "fp32" else (lambda x: x)  # noqa: E731

    def heads(x: str, n: int, d: int) -> str:  # [B,S,n*d] -> [S,B,Hv,d]
        x4 = g.op("Reshape", f(x), g.const([0, 0, n, d]))
        if n != hv:  # head i serves value heads i*r .. i*r+r-1
            x4 = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", x4, g.const([3])), g.const([1, 1, 1, hv // n, 1])),
                      g.const([0, 0, hv, d]))
        return g.op("Transpose", x4, perm=[1, 0, 2, 3])

    qn = g.op("Mul", l2norm_body(g, heads(q, hk, dk)), g.const(np.float32(scale)))
    kn = l2norm_body(g, heads(k, hk, dk))
    vn = heads(v, hv, dv)
    softplus = g.op("Softplus", g.op("Add", f(a), dt_bias))
    log_decay = g.op("Mul", g.op("Neg", g.op("Exp", a_log)), softplus)  # [B,S,Hv]
    beta = g.op("Sigmoid", f(b))
    if seq_lengths:
        valid = valid_tokens(g, q, seq_lengths)
        zero = g.const(np.float32(0.0))
        log_decay, beta = g.op("Where", valid, log_decay, zero), g.op("Where", valid, beta, zero)
    decay = g.op("Transpose", g.op("Exp", log_decay), perm=[1, 0, 2])
    return qn, kn, vn, decay, g.op("Transpose", beta, perm=[1, 0, 2])


def step(g: GraphBuilder, state: str, q: str, k: str, v: str, decay: str, beta: str) -> tuple[str, str]:
    """One token: state [B,Hv,Dv,Dk]; q,k [B,Hv,Dk]; v [B,Hv,Dv]; decay, beta [B,Hv] -> (state, y [B,Hv,Dv])."""
    s = g.op("Mul", state, g.op("Unsqueeze", decay, g.const([2, 3])))
    kcol = g.op("Unsqueeze", k, g.const([3]))  # [B,Hv,Dk,1]
    predicted = g.op("MatMul", s, kcol)  # [B,Hv,Dv,1]
    delta = g.op("Mul", g.op("Sub", g.op("Unsqueeze", v, g.const([3])), predicted), g.op("Unsqueeze", beta, g.const([2, 3])))
    s = g.op("Add", s, g.op("MatMul", delta, g.op("Unsqueeze", k, g.const([2]))))  # + delta k^T
    y = g.op("Squeeze", g.op("MatMul", s, g.op("Unsqueeze", q, g.const([3]))), g.const([3]))
    return s, y


def recurrence(g: GraphBuilder, qn: str, kn: str, vn: str, decay: str, beta: str, past_state: str, present: str,
               *, single: bool) -> str:
    """The token loop over prepared operands -> y [S,B,Hv,Dv]; writes ``present``."""
    return token_loop(g, (qn, kn, vn, decay, beta), past_state, present, step, single=single, name="gated_delta_step")


def token_loop(g: GraphBuilder, operands: tuple[str, ...], past_state: str, present: str,
               step_fn: Callable[..., tuple[str, str]], *, single: bool, name: str) -> str:
    """``state, y = step_fn(g, state, *operands[t])`` over the tokens of token-major operands [S, B, ...]
    -> y [S, B, d1, d2]; writes the last state (rank 4, float32) to ``present``. S = 1 (``single``): no Loop."""
    if single:
        at0 = lambda x: g.op("Squeeze", x, g.const([0]))  # noqa: E731
        s, y = step_fn(g, past_state, *map(at0, operands))
        g.op("Identity", s, outputs=[present])
        return g.op("Unsqueeze", y, g.const([0]))
    body = GraphBuilder(name, g.opsets)
    t, cond, s_in = "t", "cond_in", "state_in"
    at = lambda x: body.op("Squeeze", body.op("Gather", x, body.op("Unsqueeze", t, body.const([0])), axis=0),  # noqa: E731
                           body.const([0]))
    s, y = step_fn(body, s_in, *map(at, operands))
    body.op("Identity", cond, outputs=["cond_out"])
    body.op("Identity", s, outputs=["state_out"])
    body.op("Identity", y, outputs=["y_out"])
    unique = f"{name}_{len(g.nodes)}/"  # body constants must not reuse the outer graph's names
    rename = {n: unique + n for n in body.initializers}
    for node in body.nodes:
        node.input[:] = [rename.get(n, n) for n in node.input]
    consts = [helper.make_node("Constant", [], [rename[n]], value=tensor) for n, tensor in body.initializers.items()]
    graph = helper.make_graph(
        consts + body.nodes, name,
        [helper.make_tensor_value_info(t, TensorProto.INT64, []), helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         helper.make_tensor_value_info(s_in, TensorProto.FLOAT, STATE_DIMS)],
        [helper.make_tensor_value_info(n, e, d) for n, e, d in
         (("cond_out", TensorProto.BOOL, []), ("state_out", TensorProto.FLOAT, STATE_DIMS),
          ("y_out", TensorProto.FLOAT, STATE_DIMS[:3]))])
    trips = g.op("Squeeze", g.op("Shape", operands[0], end=1), g.const([0]))
    _, ys = g.op("Loop", trips, g.const(np.array(True)), past_state, outputs=[present, None], body=graph)
    return ys


def gated_delta_net_body(g: GraphBuilder, q: str, k: str, v: str, a: str, b: str, a_log: str, dt_bias: str,
                         past_state: str, seq_lengths: str, present: str, *, hk: int, hv: int, dk: int, dv: int,
                         scale: float, dtype: str, single: bool, out: str | None = None) -> str:
    """The whole op in standard ops -> y [B,S,Hv*Dv] (T); writes ``present``."""
    qn, kn, vn, decay, beta = prepare(g, q, k, v, a, b, a_log, dt_bias, seq_lengths, hk=hk, hv=hv, dk=dk, dv=dv,
                                      scale=scale, dtype=dtype)
    ys = recurrence(g, qn, kn, vn, decay, beta, past_state, present, single=single)
    y = g.op("Reshape", g.op("Transpose", ys, perm=[1, 0, 2, 3]), g.const([0, 0, hv * dv]))
    if dtype != "fp32":
        y = g.op("Cast", y, to=DTYPES[dtype])
    return g.op("Identity", y, outputs=[out])[0]


# ---- the op: shape rule, expansion body, registration --------------------------------------
def gated_delta_net_shapes(ins: list, attrs: dict, const) -> list:
    """y [B,S,Hv*Dv] (B,S of q; Hv*Dv of v); present_state = past_state's shape."""
    return [[ins[0][0], ins[0][1], ins[2][2]], list(ins[7])]


def gated_delta_net_expand(g: GraphBuilder, inputs, outputs, attrs: dict, ctx) -> None:
    q, k, v, a, b, a_log, dt_bias, past_state = inputs[:8]
    seq_lengths = inputs[8] if len(inputs) > 8 else ""
    hv, dv, dk = (ctx.static_dim(past_state, i) for i in (1, 2, 3))
    qk = ctx.static_dim(q, 2)
    if qk % dk or hv % (qk // dk) or ctx.static_dim(v, 2) != hv * dv:
        raise ctx.error(f"q/k width {qk} must be key heads x {dk} dividing {hv} value heads, v width {hv * dv}")
    try:
        single = ctx.static_dim(q, 1) == 1
    except Exception:  # noqa: BLE001 - a dynamic token count runs the Loop
        single = False
    gated_delta_net_body(g, q, k, v, a, b, a_log, dt_bias, past_state, seq_lengths, outputs[1], hk=qk // dk, hv=hv,
                         dk=dk, dv=dv, scale=float(attrs["scale"]) or dk ** -0.5, dtype=ctx.dtype(q), single=single,
                         out=outputs[0])


GATED_DELTA_NET = register(
    OpDef(
        name="GatedDeltaNet",
        inputs=("q: T [B,S,Hk*Dk]", "k: T [B,S,Hk*Dk]", "v: T [B,S,Hv*Dv]", "a: T [B,S,Hv]", "b: T [B,S,Hv]",
                "a_log: float [Hv]", "dt_bias: float [Hv]", "past_state: float [B,Hv,Dv,Dk]",
                "seq_lengths: int64 [B] (optional)"),
        outputs=("y: T [B,S,Hv*Dv]", "present_state: float [B,Hv,Dv,Dk] (aliases past_state)"),
        attributes={"scale": 0.0},
        numpy_ref=gated_delta_net_ref,
        shape_rule=gated_delta_net_shapes,
        body=gated_delta_net_expand,
        min_outputs=2,
        aliases={1: 7},
        doc=__doc__ or "",
    )
)
