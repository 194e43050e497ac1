"""Qwen3.5 (Gated DeltaNet beside gated full attention): a hybrid whose linear layers keep a conv state
and a recurrent state.

Against transformers on a tiny random checkpoint with both layer kinds, prompts longer than the conv
window and than a DeltaNet chunk (64 tokens): logits and greedy tokens for the ort, portable and trt graphs
(the trt graph run by ONNX Runtime; and built by TensorRT-RTX),
a ragged batch equal to the singles; then the runtime over the states: speculative equals plain, a
session's turns equal re-prefill. A qwen3_5 folder's language model is read too (with images:
tests/test_vision_qwen3_5.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parity import (backend, check_continuous_batching, check_greedy, check_session_turns,  # noqa: E402
                    check_speculation, check_trt_emulated, check_trt_engines, decodert_greedy, hf_reference,
                    logits_parity, random_prompts)
from tiny import make_tiny_checkpoint, tiny_config  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.artifact.manifest import load_manifest  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.models import family_for  # noqa: E402
from decodert.runtime.llm import LLM  # noqa: E402

MAX_SEQ = 112


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    src = make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5-src"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    made: dict[str, Path] = {}

    def get(target: str) -> Path:
        if target not in made:
            made[target] = tmp_path_factory.mktemp(f"qwen3_5-{target}")
            export_model(src, made[target], target=target, dtype="fp32", max_seq=MAX_SEQ, max_batch=4,
                         progress=False)
        return made[target]

    return src, model, get


def test_spec_declares_the_layer_kinds_and_states():
    spec = family_for("qwen3_5").spec_from_hf(tiny_config("qwen3_5"))
    assert spec.layer_kinds == ("linear_attention", "attention", "linear_attention") and spec.kv_layers == (1,)
    a, d = spec.attention, spec.mixer(0)
    assert d.kernel == 4 and a.qk_norm and a.output_gate and spec.rope.rotary_dim == 8
    assert (d.key_heads, d.value_heads, d.key_dim, d.value_dim) == (2, 4, 16, 8) and spec.mixer(2) is d
    assert a.qkv_rows == (2 * 4 + 2 * 2) * 32  # q, gate, k, v rows


@pytest.mark.parametrize("target", ["ort", "portable", "trt"])
def test_logits_and_greedy_match_transformers(qwen35, target):
    _, model, get = qwen35
    prompts = random_prompts((70, 5, 1))  # ragged; one longer than a DeltaNet chunk, one shorter than the conv window
    refs = [hf_reference(model, p, 9) for p in prompts]
    assert logits_parity(get(target), refs, prompts, steps=8) < 1e-4
    check_greedy(get(target), prompts, refs, 9)


def test_manifest_records_kinds_and_state_shapes(qwen35):
    _, _, get = qwen35
    m = load_manifest(get("ort"))
    assert m.kv.layer_kinds == ("linear_attention", "attention", "linear_attention") and m.kv.layers == (1,)
    channels = 2 * 2 * 16 + 4 * 8
    assert [(s.layer, s.name, s.shape) for s in m.kv.states] == [
        (0, "conv", ("batch", channels, 3)), (0, "recurrent", ("batch", 4, 8, 16)),
        (2, "conv", ("batch", channels, 3)), (2, "recurrent", ("batch", 4, 8, 16))]
    ops = {n.op_type for n in onnx.load(str(get("ort") / "decode.onnx"), load_external_data=False).graph.node}
    assert {"GatedDeltaNet", "CausalConvWithState", "GroupQueryAttention"} <= ops
    ops = {n.op_type for n in onnx.load(str(get("portable") / "prefill.onnx"), load_external_data=False).graph.node}
    assert "Loop" in ops and not ops & {"GatedDeltaNet", "CausalConvWithState"}


@pytest.mark.trt
def test_trt_graphs_build_on_tensorrt_rtx(qwen35, tmp_path):
    """TensorRT has layers for all of it: MatMuls for a decode step, an ILoop over the tokens in prefill;
    fp16, with the recurrent state in float32."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX not installed")
    src, _, _ = qwen35
    check_trt_engines(src, tmp_path / "fp16")


def test_trt_backend_on_the_emulator(qwen35, monkeypatch):
    """The trt backend binds both states of every linear layer like K/V (tests/trt_emulator.py runs the engines'
    graphs on the CPU): the ort backend's tokens, continuous batching (rows end, slots move) and speculation."""
    _, _, get = qwen35
    art = get("trt")
    check_trt_emulated(art, art, monkeypatch)


def test_continuous_batching_equals_singles(qwen35):
    """More requests (5) than slots (the artifact's max_batch 4): rows finish at different steps, new ones take
    their slots, on the ort backend."""
    _, _, get = qwen35
    check_continuous_batching(LLM.load(get("ort"), backend="ort"))


def test_speculative_equals_plain(qwen35):
    _, _, get = qwen35
    check_speculation(LLM.load(get("ort"), backend="ort"))


def test_session_turns_equal_reprefill(qwen35):
    _, _, get = qwen35
    check_session_turns(LLM.load(get("ort"), backend="ort"))


def test_multimodal_checkpoint_reads_the_language_model(qwen35, tmp_path):
    """A qwen3_5 folder without a vision_config: text_config, model.language_model.* keys read, stray vision and MTP
    keys skipped, the model text-only (with a vision_config it sees images: tests/test_vision_qwen3_5.py)."""
    from safetensors.numpy import load_file, save_file

    src, model, _ = qwen35
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"},
              "tie_word_embeddings": False}
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    mm = tmp_path / "mm"
    mm.mkdir()
    save_file(tensors, mm / "model.safetensors")
    (mm / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (mm / name).write_text((src / name).read_text())
    export_model(mm, tmp_path / "out", target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    prompt = random_prompts((9,))[0]
    ref = hf_reference(model, prompt, 6)
    assert decodert_greedy(backend(tmp_path / "out"), [prompt], 6) == [ref[0]]


def test_unknown_layer_kind_is_one_line(tmp_path):
    src = make_tiny_checkpoint("qwen3_5", tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "mamba_attention", "linear_attention"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match="mamba_attention") as e:
        export_model(src, tmp_path / "out", max_seq=32, progress=False)
    assert "\n" not in str(e.value)


# ---- GGUF: llama.cpp's qwen35 files ------------------------------------------------------------------
def _to_llama_cpp_layout(key: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """What llama.cpp's converter (conversion/qwen.py, Qwen3_5TextModel) does to a tensor: value heads
    from grouped-by-key-head to tiled order, A_log -> -exp(A_log), the conv squeezed, (1 + w) norms."""
    hk, hv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))

    def tiled(x: np.ndarray, head_dim: int, axis: int = 0) -> np.ndarray:
        x = np.moveaxis(x, axis, 0)
        x = x.reshape(hk, hv // hk, head_dim, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.moveaxis(x, 0, axis)

    if "linear_attn." in key:
        if key.endswith("in_proj_qkv.weight") or key.endswith("conv1d.weight"):
            w = np.concatenate([w[: 2 * hk * dk], tiled(w[2 * hk * dk:], dv)])
        elif key.endswith("in_proj_z.weight"):
            w = tiled(w, dv)
        elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            w = tiled(w, 1)
        elif key.endswith("out_proj.weight"):
            w = tiled(w, dv, axis=1)
    if key.endswith("A_log"):
        return -np.exp(w)
    if key.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], -1)
    if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        return w + np.float32(1.0)
    return w


def make_qwen35_gguf(src: Path, path: Path) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes it (names from the gguf package's QWEN35 map)."""
    import gguf
    from safetensors.numpy import load_file
    from tiny import _gguf_model_meta, _gguf_tokenizer_meta

    cfg = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen35")
    _gguf_model_meta(writer, "qwen35", cfg)
    _gguf_tokenizer_meta(writer, src)
    writer.add_uint32("qwen35.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    writer.add_uint32("qwen35.ssm.state_size", cfg["linear_key_head_dim"])
    writer.add_uint32("qwen35.ssm.group_count", cfg["linear_num_key_heads"])
    writer.add_uint32("qwen35.ssm.time_step_rank", cfg["linear_num_value_heads"])
    writer.add_uint32("qwen35.ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_uint32("qwen35.full_attention_interval", 2)  # the tiny layers: linear, full, linear
    rot = int(cfg["head_dim"] * 0.25)
    writer.add_array("qwen35.rope.dimension_sections", [rot // 4, rot // 8, rot // 8, 0])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg["num_hidden_layers"])
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


def test_gguf_as_llama_cpp_writes_it(tmp_path):
    """A qwen35 GGUF in llama.cpp's layout: llama.cpp itself (llama-cpp-python) reads it as transformers' model
    (so the layout is llama.cpp's), and decodert's export of it gives transformers' logits and tokens.
    llama.cpp takes the value head dim to be the key head dim (as in every released Qwen3.5): Dv = Dk here."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint("qwen3_5", tmp_path / "src", linear_value_head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    path = make_qwen35_gguf(src, tmp_path / "tiny-qwen35.gguf")
    prompt = random_prompts((13,), seed=3)[0]
    ref = hf_reference(model, prompt, 9)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # an F32 KV cache (its default F16 moves logits by 1e-3)
    llm.eval(list(map(int, prompt)))
    want = model(torch.tensor([list(map(int, prompt))])).logits[0, -1].detach().numpy()
    assert np.abs(np.asarray(llm.scores[len(prompt) - 1]) - want).max() < 1e-3 * np.abs(want).max()
    out = tmp_path / "out"
    export_model(path, out, target="ort", dtype="fp32", max_seq=32, max_batch=1, progress=False)
    assert logits_parity(out, [ref], [prompt], steps=8) < 1e-4
