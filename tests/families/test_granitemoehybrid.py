"""Granite 4.0-H (granitemoehybrid): Mamba2 and attention layers, each with the shared SwiGLU MLP, in the MoE
variant the router's experts beside it; every Granite multiplier away from 1.

Here: the spec. The battery (tests/helpers/battery.py) on tiny random checkpoints, dense and MoE (the Mamba2 math
is tested at length in tests/families/test_nemotron_h.py): logits and greedy tokens of the ort, portable and trt
graphs against transformers, batching, speculation and sessions over the states, TensorRT-RTX builds and the
emulated trt backend, an unknown layer kind refused in one line, a GGUF in llama.cpp's layout (dense).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from battery import Family, LlamaCppGguf, Parity, Refused, Runtime, TrtBuild, TrtEmulator, recurrent_engines
from tiny import tiny_config

from decodert.models import family_for

pytest.importorskip("transformers.models.granitemoehybrid")


# ---- GGUF: llama.cpp's granitehybrid files (dense MLP) --------------------------------------------------------
def make_granite_gguf(src: Path, path: Path) -> Path:
    """The tiny dense checkpoint as llama.cpp's converter writes it (names from the gguf package's GRANITE_HYBRID
    map; the shared MLP's input_linear split into ffn_gate and ffn_up; ssm tensors as for nemotron_h)."""
    import gguf
    from safetensors.numpy import load_file
    from tiny import _gguf_tokenizer_meta, mamba2_llama_cpp_layout

    cfg = json.loads((src / "config.json").read_text())
    types = cfg["layer_types"]
    arch = "granitehybrid"
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_tokenizer_meta(writer, src)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", len(types)), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("feed_forward_length", cfg["shared_intermediate_size"]), ("vocab_size", cfg["vocab_size"]),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.state_size", cfg["mamba_d_state"]),
                       ("ssm.group_count", cfg["mamba_n_groups"]), ("ssm.time_step_rank", cfg["mamba_n_heads"]),
                       ("ssm.inner_size", cfg["mamba_n_heads"] * cfg["mamba_d_head"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_array(f"{arch}.attention.head_count_kv",
                     [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in types])
    for key, value in (("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"]),
                       ("embedding_scale", cfg["embedding_multiplier"]), ("residual_scale", cfg["residual_multiplier"]),
                       ("logit_scale", cfg["logits_scaling"]), ("attention.scale", cfg["attention_multiplier"])):
        writer.add_float32(f"{arch}.{key}", float(value))
    writer.add_bool(f"{arch}.rope.scaling.finetuned", False)  # llama.cpp's "no RoPE" (position_embedding_type nope)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, len(types))
    fields = {"n_groups": cfg["mamba_n_groups"]}
    for key, w in load_file(src / "model.safetensors").items():
        if key.endswith("shared_mlp.input_linear.weight"):
            layer = key.split(".")[2]
            gate, up = np.split(w, 2)
            writer.add_tensor(f"blk.{layer}.ffn_gate.weight", np.ascontiguousarray(gate, np.float32))
            writer.add_tensor(f"blk.{layer}.ffn_up.weight", np.ascontiguousarray(up, np.float32))
            continue
        hf = key.replace(".dt_bias", ".dt_proj.bias").replace("shared_mlp.output_linear", "mlp.down_proj")
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        writer.add_tensor(name, np.ascontiguousarray(mamba2_llama_cpp_layout(key, w, fields), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GRANITE = dict(tiny="granitemoehybrid", lengths=(40, 5, 1), steps=8, seed=1,  # longer than the scan's chunk (16)
               trt_layers=recurrent_engines, replays=True)
DENSE = Family("granitemoehybrid", targets=("ort", "trt"), **GRANITE, gguf=make_granite_gguf,
               refused=(({"layer_types": ["mamba", "mamba3", "attention"]}, "layer kind 'mamba3'"),))
# not emulated: its greedy text after the emulator's prompts repeats no n-gram, so its speculation would verify
# nothing (the dense entry takes the Mamba2 states through the trt backend)
MOE = Family("granitemoehybrid_moe", overrides={"num_local_experts": 4}, targets=("ort", "portable"), emulator="",
             **GRANITE)


class TestBattery(Parity, Runtime, TrtBuild, TrtEmulator, Refused, LlamaCppGguf):
    entries = (DENSE, MOE)


def test_spec_reads_kinds_multipliers_and_experts():
    spec = family_for("granitemoehybrid").spec_from_hf(tiny_config("granitemoehybrid"))
    assert spec.layer_kinds == ("mamba2", "attention", "mamba2") and spec.kv_layers == (1,)
    m = spec.mixer(0)
    assert (m.heads, m.head_dim, m.state, m.groups) == (8, 16, 16, 2)
    assert (spec.embed_scale, spec.residual_scale, spec.attention.scale, spec.logits_scaling) == (3.0, 0.5, 0.1, 2.0)
    assert spec.experts() is None and spec.mlp_size(0) == 96
    assert spec.attention.rope_table == "rope_none"  # no position embedding: the identity rotation
    moe = family_for("granitemoehybrid").spec_from_hf(tiny_config("granitemoehybrid", num_local_experts=4)).mlp(0)
    assert moe.num_experts == 4 and moe.shared.size == 96 and moe.expert_size == 32
