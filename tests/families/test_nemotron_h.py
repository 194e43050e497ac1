"""Nemotron-H (Mamba2 blocks beside attention and ReLU² MLP blocks): a hybrid whose Mamba2 layers keep a conv
state and an SSM state, and whose layers are single blocks (a mixer without an MLP, an MLP without a mixer).

Here: the spec, the Mamba2SSM op's numpy reference against transformers' torch scan (recurrent and chunked), its
standard-op body against the reference (one token, several, right-padded rows). The battery
(tests/helpers/battery.py) on a tiny random checkpoint with every block kind and prompts longer than the conv
window and the scan's chunk: logits and greedy tokens of the ort, portable and trt graphs against transformers,
batching, speculation and sessions over the states, TensorRT-RTX builds and the emulated trt backend, the
manifest's states, bad block types refused in one line, a GGUF in llama.cpp's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from battery import Family, LlamaCppGguf, Parity, Refused, Runtime, States, TrtBuild, TrtEmulator, recurrent_engines
from seeds import RUN_SEED
from tiny import mamba2_llama_cpp_layout, tiny_config

from decodert.models import family_for
from decodert.plugins.catalog import get_op
from decodert.plugins.expand import expand_plugin_nodes
from decodert.plugins.ops.mamba2_ssm import mamba2_ssm_ref
from decodert.plugins.registry import DOMAIN

nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
SEED = RUN_SEED  # the run's seed (tests/helpers/seeds.py): $DECODERT_TEST_SEED, else drawn once
KINDS = ("mamba2", "mamba2", "attention", "none", "mamba2", "none")  # the tiny pattern MM*-M-


# ---- GGUF: llama.cpp's nemotron_h files -----------------------------------------------------------------------
def make_nemotron_gguf(src: Path, path: Path) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes it (names from the gguf package's NEMOTRON_H map;
    per-layer head_count_kv and feed_forward_length say each block's type)."""
    import gguf
    from safetensors.numpy import load_file
    from tiny import _gguf_tokenizer_meta

    cfg = json.loads((src / "config.json").read_text())
    types = cfg["layers_block_type"]
    arch = "nemotron_h"
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_tokenizer_meta(writer, src)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", len(types)), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("vocab_size", cfg["vocab_size"]), ("ssm.conv_kernel", cfg["conv_kernel"]),
                       ("ssm.state_size", cfg["ssm_state_size"]), ("ssm.group_count", cfg["n_groups"]),
                       ("ssm.time_step_rank", cfg["mamba_num_heads"]),
                       ("ssm.inner_size", cfg["mamba_num_heads"] * cfg["mamba_head_dim"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_array(f"{arch}.attention.head_count_kv",
                     [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in types])
    writer.add_array(f"{arch}.feed_forward_length", [cfg["intermediate_size"] if t == "mlp" else 0 for t in types])
    writer.add_float32(f"{arch}.attention.layer_norm_epsilon", cfg["layer_norm_epsilon"])  # the key llama.cpp reads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NEMOTRON_H, len(types))
    for key, w in load_file(src / "model.safetensors").items():
        hf = key.replace(".dt_bias", ".dt_proj.bias")
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        writer.add_tensor(name, np.ascontiguousarray(mamba2_llama_cpp_layout(key, w, cfg), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CHANNELS = 4 * 8 + 2 * 2 * 16  # the conv over x (4 heads of 8) and B, C (2 groups of 16)
NEMOTRON = Family("nemotron_h", lengths=(70, 5, 1), steps=8,  # ragged; longer than the scan's chunk (16), shorter than the conv
                  trt_layers=recurrent_engines, replays=True, kinds=KINDS, kv_layers=(2,),
                  states=tuple((i, name, shape) for i in (0, 1, 4) for name, shape in (
                      ("conv", ("batch", CHANNELS, 3)), ("recurrent", ("batch", 4, 16, 8)))),
                  ops=(("ort", "decode", frozenset({"LinearAttention", "CausalConvWithState", "GroupQueryAttention"}),
                        frozenset()),
                       ("portable", "prefill", frozenset({"Loop"}), frozenset({"LinearAttention", "CausalConvWithState"}))),
                  refused=tuple(({"layers_block_type": None, "hybrid_override_pattern": pattern}, match)
                                for pattern, match in (("M*X-", "layer kind 'X'"), ("ME*-", "MoE blocks"))),
                  gguf=make_nemotron_gguf)


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator, States, Refused, LlamaCppGguf):
    entries = (NEMOTRON,)


def test_spec_declares_blocks_and_states():
    spec = family_for("nemotron_h").spec_from_hf(tiny_config("nemotron_h"))
    assert spec.layer_kinds == KINDS and spec.kv_layers == (2,)
    assert tuple(layer.mlp_kind for layer in spec.layers) == ("none", "none", "none", "dense", "none", "dense")
    mlp, m = spec.mlp(3), spec.mixer(0)
    assert not mlp.gated and mlp.activation == "relu2" and m.conv_bias
    assert (m.heads, m.head_dim, m.state, m.groups) == (4, 8, 16, 2)
    assert spec.attention.rope_table == "rope_none"  # no position embedding in the attention block


# ---- the op: reference against transformers, body against the reference ---------------------------------------
def _inputs(rng, b, s, h, dh, groups, n):
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(x=r(b, s, h * dh), dt=r(b, s, h), b=r(b, s, groups * n), c=r(b, s, groups * n),
                a_log=np.log(rng.uniform(0.5, 8, h)).astype(np.float32), dt_bias=r(h), d=r(h),
                past_state=r(b, h, n, dh) * 0.3)


@pytest.mark.parametrize("s,h,groups,chunk", [(1, 4, 2, None), (9, 4, 1, None), (21, 4, 2, 8), (40, 2, 2, 16)])
def test_numpy_reference_matches_transformers(s, h, groups, chunk):
    rng = np.random.default_rng(SEED)
    dh, n = 8, 16
    x = _inputs(rng, 2, s, h, dh, groups, n)
    y, state = mamba2_ssm_ref(**x)
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    a = -t["a_log"].exp()
    init = t["past_state"].transpose(-1, -2).contiguous()  # transformers' [B, H, Dh, N]
    if chunk is None:  # the recurrent form, token by token
        st, ys = init.clone(), []
        for j in range(s):
            ys.append(nh.mamba2_selective_state_update(
                st, t["x"][:, j].view(2, h, dh), t["dt"][:, j, :, None].expand(-1, -1, dh),
                a[:, None, None].expand(-1, dh, n), t["b"][:, j].view(2, groups, n), t["c"][:, j].view(2, groups, n),
                t["d"][:, None].expand(-1, dh), dt_bias=t["dt_bias"][:, None].expand(-1, dh), dt_softplus=True))
        want_y, want_state = torch.stack(ys, 1).reshape(2, s, h * dh), st
    else:
        want_y, want_state = nh.mamba2_chunk_scan(
            t["x"].view(2, s, h, dh), t["dt"], a, t["b"].view(2, s, groups, n), t["c"].view(2, s, groups, n),
            chunk_size=chunk, D=t["d"], dt_bias=t["dt_bias"], initial_states=init, dt_softplus=True,
            return_final_states=True)
        want_y = want_y.reshape(2, s, h * dh)
    scale = max(float(want_y.abs().max()), 1.0)
    assert np.abs(y - want_y.numpy()).max() < 1e-4 * scale, f"seed {SEED}"
    assert np.abs(state - want_state.transpose(-1, -2).numpy()).max() < 1e-4 * scale, f"seed {SEED}"


def _run_op(inputs: dict) -> list[np.ndarray]:
    """One Mamba2SSM node over graph inputs (static shapes: S = 1 is the one-token body), expanded, run by ORT."""
    node = helper.make_node("Mamba2SSM", list(inputs), ["y", "present"], domain=DOMAIN)
    vi = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
          for n, a in inputs.items()]
    shapes = get_op("Mamba2SSM").output_shapes([list(a.shape) for a in inputs.values()], {})
    graph = helper.make_graph([node], "t", vi, [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, shape)
                                                for o, shape in zip(("y", "present"), shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    expanded = expand_plugin_nodes(model)
    onnx.checker.check_model(expanded, full_check=True)
    sess = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


@pytest.mark.parametrize("s,padded", [(1, False), (7, False), (7, True)])
def test_reference_body_matches_numpy(s, padded):
    rng = np.random.default_rng(SEED)
    x = _inputs(rng, 3, s, 4, 8, 2, 16)
    if padded:
        x["seq_lengths"] = np.array([s, 4, 1], np.int64)
    y, state = _run_op(x)
    want_y, want_state = mamba2_ssm_ref(*x.values())
    valid = np.arange(s)[None, :] < x.get("seq_lengths", np.full(3, s))[:, None]
    assert np.abs((y - want_y)[valid]).max() < 1e-4 * np.abs(want_y).max(), f"seed {SEED}"
    assert np.abs(state - want_state).max() < 1e-4 * np.abs(want_state).max(), f"seed {SEED}"
    if padded:  # a padded row's state is its single run's
        one = {k: (v[1:2, :4] if v.ndim == 3 else v[1:2] if k == "past_state" else v) for k, v in x.items()
               if k != "seq_lengths"}
        assert np.abs(state[1] - mamba2_ssm_ref(*one.values())[1][0]).max() < 1e-5 * np.abs(state[1]).max()
