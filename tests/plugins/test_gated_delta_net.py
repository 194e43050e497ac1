"""Gated DeltaNet and CausalConv, defined once in plugins/ops/: numpy references against transformers'
Qwen3.5 torch code (recurrent and chunked rule, the whole linear-attention layer), reference ONNX
bodies against the numpy references (one token, several tokens, right-padded rows).

Random inputs are fresh each run (seed printed on failure; DECODERT_TEST_SEED=n repeats one).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from seeds import RUN_SEED
from decodert.plugins.catalog import get_op
from decodert.plugins.expand import expand_plugin_nodes
from decodert.plugins.ops.gated_delta_net import gated_delta_net_ref
from decodert.plugins.ops.causal_conv import causal_conv_ref
from decodert.plugins.registry import DOMAIN
from decodert.plugins.ops.rms_norm import rms_norm_ref

q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
SEED = RUN_SEED  # the run's seed (tests/helpers/seeds.py): $DECODERT_TEST_SEED, else drawn once


def _close(got, want, tol, what):
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max())
    assert np.shape(got) == np.shape(want) and err <= tol * scale, f"{what}: max err {err:.3g}, seed {SEED}"


def _gdn_inputs(rng, b, s, hk, hv, dk, dv):
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(q=r(b, s, hk * dk), k=r(b, s, hk * dk), v=r(b, s, hv * dv), a=r(b, s, hv), b=r(b, s, hv),
                a_log=np.log(rng.uniform(0.5, 8, hv)).astype(np.float32), dt_bias=r(hv),
                past_state=r(b, hv, dv, dk) * 0.3)


def _torch_rule(x, hk, hv, dk, dv, chunk: int | None):
    """transformers' gated delta rule on the same inputs (its state is [B,Hv,Dk,Dv]: ours transposed)."""
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    b, s = x["q"].shape[:2]
    g = -t["a_log"].exp() * torch.nn.functional.softplus(t["a"] + t["dt_bias"])
    args = (t["q"].view(b, s, hk, dk), t["k"].view(b, s, hk, dk), t["v"].view(b, s, hv, dv), g, t["b"].sigmoid())
    init = t["past_state"].transpose(-1, -2).contiguous()
    if chunk is None:
        y, st = q35.torch_recurrent_gated_delta_rule(*args, initial_state=init, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    else:
        y, st = q35.torch_chunk_gated_delta_rule(*args, chunk_size=chunk, initial_state=init, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    return y.reshape(b, s, hv * dv).numpy(), st.transpose(-1, -2).numpy()


@pytest.mark.parametrize("s,hk,hv,chunk", [(1, 2, 2, None), (9, 2, 4, None), (21, 1, 2, 8), (70, 2, 4, 64)])
def test_numpy_rule_matches_transformers(s, hk, hv, chunk):
    rng = np.random.default_rng(SEED)
    dk, dv = 8, 16
    x = _gdn_inputs(rng, 2, s, hk, hv, dk, dv)
    y, state = gated_delta_net_ref(*x.values())
    ty, tstate = _torch_rule(x, hk, hv, dk, dv, chunk)
    _close(y, ty, 1e-4, "y")
    _close(state, tstate, 1e-4, "state")


def _layer(rng, hidden=24, hk=2, hv=4, dk=8, dv=6, kernel=4):
    cfg = q35.Qwen3_5TextConfig(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(int(rng.integers(2**31)))
    layer = q35.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.rand_like(layer.A_log).mul(2).add(0.1).log())
    return layer


def _layer_ref(layer, x, conv_state, state):
    """The whole Qwen3.5 linear-attention mixer from the two ops + the gated RMSNorm, in numpy."""
    w = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    b, s, _ = x.shape
    kd = layer.key_dim
    mixed, conv_state = causal_conv_ref(x @ w["in_proj_qkv.weight"].T, w["conv1d.weight"][:, 0], conv_state,
                                        activation="silu")
    q, k, v = np.split(mixed, [kd, 2 * kd], axis=-1)
    y, state = gated_delta_net_ref(q, k, v, x @ w["in_proj_a.weight"].T, x @ w["in_proj_b.weight"].T, w["A_log"],
                                   w["dt_bias"], state)
    z = (x @ w["in_proj_z.weight"].T).reshape(b, s, -1, layer.head_v_dim)
    normed, _ = rms_norm_ref(y.reshape(b, s, -1, layer.head_v_dim), w["norm.weight"], epsilon=layer.layer_norm_epsilon)
    gated = (normed * (z / (1 + np.exp(-z)))).reshape(b, s, -1)
    return gated @ w["out_proj.weight"].T, conv_state, state


def test_layer_in_pieces_matches_transformers_whole():
    """Prefill 11 tokens, one step, 5 more, with both states carried == the module over all 17."""
    rng = np.random.default_rng(SEED)
    layer = _layer(rng)
    x = rng.standard_normal((2, 17, 24)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    conv_state = np.zeros((2, layer.conv_dim, layer.conv_kernel_size - 1), np.float32)
    state = np.zeros((2, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), np.float32)
    outs = []
    for lo, hi in ((0, 11), (11, 12), (12, 17)):
        y, conv_state, state = _layer_ref(layer, x[:, lo:hi], conv_state, state)
        outs.append(y)
    _close(np.concatenate(outs, axis=1), want, 1e-4, "layer output")


def test_conv_matches_transformers_update_and_fn():
    rng = np.random.default_rng(SEED)
    c, kernel = 10, 4
    w = rng.standard_normal((c, kernel)).astype(np.float32)
    x = rng.standard_normal((2, 7, c)).astype(np.float32)
    zero = np.zeros((2, c, kernel - 1), np.float32)
    y, state = causal_conv_ref(x, w, zero, activation="silu")
    want = q35.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), activation="silu")
    _close(y, want.transpose(1, 2).numpy(), 1e-5, "fn")
    step = rng.standard_normal((2, 1, c)).astype(np.float32)
    y1, state1 = causal_conv_ref(step, w, state, activation="silu")
    tstate = torch.from_numpy(state.copy())
    want1 = q35.causal_conv1d_update(torch.from_numpy(step).transpose(1, 2), tstate, torch.from_numpy(w), None, "silu")
    _close(y1, want1.transpose(1, 2).numpy(), 1e-5, "update")
    _close(state1, tstate.numpy(), 0, "update state")


# ---- reference bodies against the numpy references -------------------------------------
def _run(op: str, inputs: dict, out_types: list[int], **attrs) -> list[np.ndarray]:
    """One decodert node over graph inputs (static shapes), expanded, run by ONNX Runtime."""
    outs = [f"out{i}" for i in range(len(out_types))]
    node = helper.make_node(op, list(inputs), outs, name=f"/test/{op}", domain=DOMAIN, **attrs)
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
          for n, a in inputs.items()]
    shapes = get_op(op).output_shapes([list(a.shape) for a in inputs.values()], attrs)
    graph = helper.make_graph([node], "t", vi, [helper.make_tensor_value_info(o, t, shape)
                                                for o, t, shape in zip(outs, out_types, shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    expanded = expand_plugin_nodes(model)
    onnx.checker.check_model(expanded, full_check=True)
    sess = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


F = onnx.TensorProto.FLOAT


@pytest.mark.parametrize("s,ragged", [(1, False), (6, False), (6, True)])
def test_gated_delta_net_body_matches_numpy(s, ragged):
    rng = np.random.default_rng(SEED)
    x = _gdn_inputs(rng, 3, s, 2, 4, 8, 16)
    if ragged:
        x["seq_lengths"] = np.array([s, 2, 5], np.int64)
    got = _run("GatedDeltaNet", x, [F, F])
    want = gated_delta_net_ref(*x.values())
    _close(got[0], want[0], 1e-5, "y")
    _close(got[1], want[1], 1e-5, "state")
    assert get_op("GatedDeltaNet").output_shapes([list(a.shape) for a in x.values()], {}) == [list(w.shape) for w in want]
    if ragged:  # a padded row's state is its single run's
        one = {k: (v[1:2, :2] if v.ndim == 3 else v[1:2] if k == "past_state" else v) for k, v in x.items()}
        del one["seq_lengths"]
        _close(got[1][1:2], gated_delta_net_ref(*one.values())[1], 1e-5, "row 1 state")


@pytest.mark.parametrize("s,ragged,act", [(1, False, "silu"), (5, True, "none"), (2, True, "silu")])
def test_causal_conv_body_matches_numpy(s, ragged, act):
    rng = np.random.default_rng(SEED)
    c, kernel = 12, 4
    x = dict(x=rng.standard_normal((3, s, c)).astype(np.float32),
             weight=rng.standard_normal((c, kernel)).astype(np.float32),
             past_state=rng.standard_normal((3, c, kernel - 1)).astype(np.float32))
    if ragged:
        x["seq_lengths"] = np.array([s, 1, max(s - 1, 0)], np.int64)
    got = _run("CausalConv", x, [F, F], activation=act)
    want = causal_conv_ref(*x.values(), activation=act)
    _close(got[0], want[0], 1e-5, "y")
    _close(got[1], want[1], 0, "state")
    if ragged:  # row 1 holds its one token after the last two of its past
        np.testing.assert_array_equal(got[1][1], np.concatenate([x["past_state"][1][:, 1:], x["x"][1, :1].T], axis=1))
