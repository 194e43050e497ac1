"""Qwen3.5 (Gated DeltaNet beside gated full attention): a hybrid whose linear layers keep a conv state
and a recurrent state.

The battery (tests/helpers/battery.py) on a tiny random checkpoint with both layer kinds, prompts longer than
the conv window and than a DeltaNet chunk (64 tokens): logits and greedy tokens of the ort, portable and trt
graphs against transformers, batching, speculation and sessions over the states, TensorRT-RTX builds and the
emulated trt backend, the manifest's states, a GGUF in llama.cpp's layout. Here: the spec, and a qwen3_5
folder's language model read (with images: tests/vision/test_vision_qwen3_5.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from battery import Family, LlamaCppGguf, Parity, Refused, Runtime, States, TrtBuild, TrtEmulator, recurrent_engines
from parity import backend, decodert_greedy, hf_reference, random_prompts
from tiny import tiny_config

from decodert.export.pipeline import export_model
from decodert.models import family_for


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


CHANNELS = 2 * 2 * 16 + 4 * 8  # the conv over q, k (2 key heads of 16) and v (4 value heads of 8)
QWEN35 = Family("qwen3_5", lengths=(70, 5, 1), steps=8,  # ragged; one longer than a DeltaNet chunk, one shorter than the conv
                trt_layers=recurrent_engines, replays=True, kinds=("linear_attention", "attention", "linear_attention"), kv_layers=(1,),
                states=tuple((i, name, shape) for i in (0, 2) for name, shape in (
                    ("conv", ("batch", CHANNELS, 3)), ("recurrent", ("batch", 4, 8, 16)))),
                ops=(("ort", "decode", frozenset({"GatedDeltaNet", "CausalConvWithState", "GroupQueryAttention"}), frozenset()),
                     ("portable", "prefill", frozenset({"Loop"}), frozenset({"GatedDeltaNet", "CausalConvWithState"}))),
                refused=(({"layer_types": ["linear_attention", "mamba_attention", "linear_attention"]}, "mamba_attention"),),
                # llama.cpp takes the value head dim to be the key head dim (as in every released Qwen3.5): Dv = Dk
                gguf=make_qwen35_gguf, gguf_overrides={"linear_value_head_dim": 16})


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator, States, Refused, LlamaCppGguf):
    entries = (QWEN35,)


def test_spec_declares_the_layer_kinds_and_states():
    spec = family_for("qwen3_5").spec_from_hf(tiny_config("qwen3_5"))
    assert spec.layer_kinds == ("linear_attention", "attention", "linear_attention") and spec.kv_layers == (1,)
    a, d = spec.attention, spec.mixer(0)
    assert d.kernel == 4 and a.qk_norm and a.output_gate and spec.rope.rotary_dim == 8
    assert (d.key_heads, d.value_heads, d.key_dim, d.value_dim) == (2, 4, 16, 8) and spec.mixer(2) is d
    assert a.qkv_rows == (2 * 4 + 2 * 2) * 32  # q, gate, k, v rows


def test_multimodal_checkpoint_reads_the_language_model(family_artifacts, tmp_path):
    """A qwen3_5 folder without a vision_config: text_config, model.language_model.* keys read, stray vision and MTP
    keys skipped, the model text-only (with a vision_config it sees images: tests/vision/test_vision_qwen3_5.py)."""
    from safetensors.numpy import load_file, save_file

    src, model = family_artifacts.source(QWEN35), family_artifacts.model(QWEN35)
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
