"""open_checkpoint: HF safetensors (single, sharded, bf16) and GGUF, tokenizers, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny import CHAT_TEMPLATE, FAMILIES  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.checkpoint import open_checkpoint  # noqa: E402
from decodert.models.spec import canonical_shape  # noqa: E402


def torch_weights(model, spec) -> dict:
    """Canonical name -> np.float32, read from a transformers model's modules (not its state-dict keys)."""
    import torch

    def arr(*ts):
        return torch.cat([t.detach().float() for t in ts], 0).numpy()

    m = model.model
    out = {"embed": arr(m.embed_tokens.weight), "final_norm": arr(m.norm.weight)}
    if not spec.tie_word_embeddings:
        out["lm_head"] = arr(model.lm_head.weight)
    for i, layer in enumerate(m.layers):
        a, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}."
        out[p + "input_norm"] = arr(layer.input_layernorm.weight)
        out[p + "post_norm"] = arr(layer.post_attention_layernorm.weight)
        out[p + "o"] = arr(a.o_proj.weight)
        out[p + "down"] = arr(mlp.down_proj.weight)
        if hasattr(a, "qkv_proj"):
            out[p + "qkv"] = arr(a.qkv_proj.weight)
        else:
            out[p + "qkv"] = arr(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        if spec.qkv_bias:
            out[p + "qkv_bias"] = arr(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        if spec.qk_norm:
            out[p + "q_norm"], out[p + "k_norm"] = arr(a.q_norm.weight), arr(a.k_norm.weight)
        out[p + "gate_up"] = (arr(mlp.gate_up_proj.weight) if hasattr(mlp, "gate_up_proj")
                              else arr(mlp.gate_proj.weight, mlp.up_proj.weight))
    return out


def load_torch(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def assert_matches(ckpt, expected, atol=0.0):
    assert set(ckpt.names()) == set(expected)
    for name in ckpt.names():
        w = ckpt.tensor(name)
        assert w.dtype == np.float32 and w.shape == canonical_shape(ckpt.spec, name), name
        assert w.flags.c_contiguous and w.flags.writeable
        np.testing.assert_allclose(w, expected[name], atol=atol, rtol=0, err_msg=name)


# -- HF safetensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tensors_equal_torch_modules(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    with open_checkpoint(path) as ckpt:
        assert ckpt.kind == "hf" and ckpt.source == path
        assert_matches(ckpt, torch_weights(load_torch(path), ckpt.spec))


def test_tied_llama_has_no_lm_head(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("llama_tied"))
    assert ckpt.spec.tie_word_embeddings and "lm_head" not in ckpt.names()
    with pytest.raises(KeyError):
        ckpt.tensor("lm_head")


def test_sharded_safetensors(tiny_checkpoint):
    path = tiny_checkpoint("qwen2", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (path / "model.safetensors").exists()
    single = open_checkpoint(tiny_checkpoint("qwen2"))
    sharded = open_checkpoint(path)
    assert sharded.spec == single.spec
    for name in single.names():
        np.testing.assert_array_equal(sharded.tensor(name), single.tensor(name), err_msg=name)


def test_bf16_checkpoint(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", dtype="bfloat16")
    header_len = int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    ckpt = open_checkpoint(path)
    expected = torch_weights(load_torch(path), ckpt.spec)  # bf16 values, upcast by torch
    assert_matches(ckpt, expected)
    fp32 = open_checkpoint(tiny_checkpoint("qwen3")).tensor("layers.0.qkv")
    np.testing.assert_allclose(ckpt.tensor("layers.0.qkv"), fp32, rtol=2**-7, atol=0)


def test_hf_write_tokenizer(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer

    src = tiny_checkpoint("llama3")
    info = open_checkpoint(src).write_tokenizer(tmp_path / "out")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert info == {"bos_token_id": 0, "eos_token_ids": [2, 0], "pad_token_id": 0, "add_bos_token": False,
                    "chat_template": CHAT_TEMPLATE}
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids, skip_special_tokens=False).endswith("world<|im_end|>")


def test_hf_tokenizer_fallbacks(tiny_checkpoint, tmp_path):
    """eos from config.json when generation_config.json is absent; chat_template.jinja; list templates."""
    import shutil

    src = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), src)
    (src / "generation_config.json").unlink()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    del cfg["chat_template"], cfg["add_bos_token"]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    info = open_checkpoint(src).write_tokenizer(tmp_path / "out")
    assert info["eos_token_ids"] == [2] and info["chat_template"] == "{{ messages }}"
    assert info["add_bos_token"] is False and (tmp_path / "out" / "chat_template.jinja").is_file()
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert open_checkpoint(src).write_tokenizer(tmp_path / "out2")["chat_template"] == "D"
