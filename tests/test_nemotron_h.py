"""Nemotron-H (Mamba2 blocks beside attention and ReLU² MLP blocks): a hybrid whose Mamba2 layers keep a conv
state and an SSM state, and whose layers are single blocks (a mixer without an MLP, an MLP without a mixer).

The Mamba2SSM op's numpy reference against transformers' torch scan (recurrent and chunked), its standard-op
body against the reference (one token, several, right-padded rows); then against transformers on a tiny random
checkpoint with every block kind and prompts longer than the conv window and the scan's chunk: logits and greedy
tokens for the ort, portable and trt graphs, a ragged batch equal to the singles; the runtime over the states:
continuous batching, speculative equals plain, a session's turns equal re-prefill, the trt backend on the emulator;
the trt graphs built by TensorRT-RTX; a GGUF in llama.cpp's layout; bad block types refused in one line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

sys.path.insert(0, str(Path(__file__).parent))
from parity import (check_continuous_batching, check_greedy, check_session_turns,  # noqa: E402
                    check_speculation, check_trt_emulated, check_trt_engines, hf_reference,
                    logits_parity, random_prompts)
from tiny import make_tiny_checkpoint, tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models import family_for  # noqa: E402
from decodert.plugins.catalog import get_op  # noqa: E402
from decodert.plugins.expand import expand_plugin_nodes  # noqa: E402
from decodert.plugins.ops.mamba2_ssm import mamba2_ssm_ref  # noqa: E402
from decodert.plugins.registry import DOMAIN  # noqa: E402
from decodert.runtime.llm import LLM  # noqa: E402

nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
SEED = int(os.environ.get("DECODERT_TEST_SEED") or np.random.SeedSequence().entropy % 2**31)
MAX_SEQ = 112
KINDS = ("mamba2", "mamba2", "attention", "none", "mamba2", "none")  # the tiny pattern MM*-M-


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    src = make_tiny_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron_h-src"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    made: dict[str, Path] = {}

    def get(target: str) -> Path:
        if target not in made:
            made[target] = tmp_path_factory.mktemp(f"nemotron_h-{target}")
            export_model(src, made[target], target=target, dtype="fp32", max_seq=MAX_SEQ, max_batch=4, progress=False)
        return made[target]

    return src, model, get


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


# ---- the model against transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_logits_and_greedy_match_transformers(nemotron, target):
    _, model, get = nemotron
    prompts = random_prompts((70, 5, 1))  # ragged; one longer than the scan's chunk (16), one shorter than the conv
    refs = [hf_reference(model, p, 9) for p in prompts]
    assert logits_parity(get(target), refs, prompts, steps=8) < 1e-4
    check_greedy(get(target), prompts, refs, 9)


def test_manifest_records_kinds_and_state_shapes(nemotron):
    _, _, get = nemotron
    m = load_manifest(get("ort"))
    assert m.kv.layer_kinds == KINDS and m.kv.layers == (2,)
    channels = 4 * 8 + 2 * 2 * 16
    assert [(s.layer, s.name, s.shape) for s in m.kv.states] == [
        (i, name, shape) for i in (0, 1, 4)
        for name, shape in (("conv", ("batch", channels, 3)), ("recurrent", ("batch", 4, 16, 8)))]
    ops = {n.op_type for n in onnx.load(str(get("ort") / "decode.onnx"), load_external_data=False).graph.node}
    assert {"LinearAttention", "CausalConvWithState", "GroupQueryAttention"} <= ops
    ops = {n.op_type for n in onnx.load(str(get("portable") / "prefill.onnx"), load_external_data=False).graph.node}
    assert "Loop" in ops and not ops & {"LinearAttention", "CausalConvWithState"}


@pytest.mark.trt
def test_trt_graphs_build_on_tensorrt_rtx(nemotron, tmp_path):
    """TensorRT has layers for all of it: MatMuls for a decode step, an ILoop over the tokens in prefill;
    fp16, with the SSM state in float32."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    src, _, _ = nemotron
    check_trt_engines(src, tmp_path / "fp16")


def test_trt_backend_on_the_emulator(nemotron, monkeypatch):
    """The trt backend binds both states of every Mamba2 layer like K/V (tests/trt_emulator.py runs the engines'
    graphs on the CPU): the ort backend's tokens, continuous batching and speculation."""
    _, _, get = nemotron
    art = get("trt")
    check_trt_emulated(get("ort"), art, monkeypatch)


def test_continuous_batching_equals_singles(nemotron):
    """More requests (5) than slots (4): rows finish at different steps, new ones take their slots."""
    _, _, get = nemotron
    check_continuous_batching(LLM.load(get("ort"), backend="ort"))


def test_speculative_equals_plain(nemotron):
    _, _, get = nemotron
    check_speculation(LLM.load(get("ort"), backend="ort"))


def test_session_turns_equal_reprefill(nemotron):
    _, _, get = nemotron
    check_session_turns(LLM.load(get("ort"), backend="ort"))


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,match", [("M*X-", "layer kind 'X'"), ("ME*-", "MoE blocks")])
def test_unknown_or_moe_block_is_one_line(tmp_path, pattern, match):
    src = make_tiny_checkpoint("nemotron_h", tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config.pop("layers_block_type", None)
    config["hybrid_override_pattern"] = pattern
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match=match) as e:
        export_model(src, tmp_path / "out", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


# ---- GGUF: llama.cpp's nemotron_h files -----------------------------------------------------------------------
def _to_llama_cpp_layout(key: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """What llama.cpp's converter (Mamba2 / NemotronH models) does to a tensor: A_log -> -exp(A_log) [H, 1],
    D [H, 1], the conv squeezed [C, K], the gated norm [G, Di/G]."""
    if key.endswith("A_log"):
        return -np.exp(w)[:, None]
    if key.endswith((".mixer.D", ".mamba.D")):
        return w[:, None]
    if key.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], -1)
    if key.endswith((".mixer.norm.weight", ".mamba.norm.weight")):
        return w.reshape(cfg["n_groups"], -1)
    return w


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
        writer.add_tensor(name, np.ascontiguousarray(_to_llama_cpp_layout(key, w, cfg), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_as_llama_cpp_writes_it(nemotron, tmp_path):
    """A nemotron_h GGUF in llama.cpp's layout: llama.cpp itself (llama-cpp-python) reads it as transformers'
    model (so the layout is llama.cpp's), and decodert's export of it gives transformers' logits and tokens."""
    src, model, _ = nemotron
    path = make_nemotron_gguf(src, tmp_path / "tiny-nemotron_h.gguf")
    prompt = random_prompts((13,), seed=3)[0]
    ref = hf_reference(model, prompt, 9)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # an F32 KV cache
    llm.eval(list(map(int, prompt)))
    want = model(torch.tensor([list(map(int, prompt))])).logits[0, -1].detach().numpy()
    assert np.abs(np.asarray(llm.scores[len(prompt) - 1]) - want).max() < 1e-3 * np.abs(want).max()
    out = tmp_path / "out"
    export_model(path, out, target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    assert logits_parity(out, [ref], [prompt], steps=8) < 1e-4
