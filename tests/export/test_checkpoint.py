"""open_checkpoint on HF folders: safetensors (single, sharded, bf16), tokenizer files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny import CHAT_TEMPLATE, FAMILIES, assert_matches, load_torch, one_line_error, torch_weights  # noqa: E402

from decodert.export.checkpoints.checkpoint_open import open_checkpoint  # noqa: E402
from decodert.models import family_names  # noqa: E402


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


# -- bad input ------------------------------------------------------------------------------------


def copy_of(tiny_checkpoint, tmp_path, family="llama", **overrides) -> Path:
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(family, **overrides), dst)
    return dst


def test_missing_paths(tmp_path):
    assert str(tmp_path / "nope") in one_line_error(tmp_path / "nope", "no such file")
    assert str(tmp_path) in one_line_error(tmp_path, "no config.json")
    (tmp_path / "config.json").write_text("{not json")
    one_line_error(tmp_path, "invalid JSON")
    (tmp_path / "x.bin").write_bytes(b"hello")
    one_line_error(tmp_path / "x.bin", "not a Hugging Face checkpoint folder or a GGUF file")
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(100))
    one_line_error(tmp_path / "x.gguf", "bad magic")


def test_unknown_architecture(tiny_checkpoint, tmp_path):
    path = copy_of(tiny_checkpoint, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    msg = one_line_error(path, "unknown architecture 'gpt_neox'")
    assert str(path / "config.json") in msg and f"supported: {', '.join(family_names())}" in msg


def test_unsupported_config_names_the_file(tiny_checkpoint, tmp_path):
    path = copy_of(tiny_checkpoint, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    assert str(path / "config.json") in one_line_error(path, "mixture-of-experts")


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    path = copy_of(tiny_checkpoint, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert str(path / "model.safetensors") in one_line_error(path, "past the end of the file")
    (path / "model.safetensors").write_bytes(data[:100])
    one_line_error(path, "truncated safetensors file")
    (path / "model.safetensors").write_bytes(b"")
    one_line_error(path, "truncated safetensors file")


def test_missing_tensor_shard_and_bad_shape(tiny_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = copy_of(tiny_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    one_line_error(path, "tensor 'model.layers.1.mlp.up_proj.weight' not found")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    one_line_error(path, "has shape [128, 64], expected [96, 64]")

    sharded = tiny_checkpoint("llama", max_shard_size="40KB")
    path2 = tmp_path / "sharded"
    import shutil

    shutil.copytree(sharded, path2)
    shard = sorted(path2.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert str(shard) in one_line_error(path2, "missing shard file")


def test_pytorch_bin_only(tiny_checkpoint, tmp_path):
    path = copy_of(tiny_checkpoint, tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    one_line_error(path, "only safetensors")


def test_huge_declared_size_is_not_allocated(tmp_path):
    """A header declaring a 1 TB tensor in a tiny file fails on the header check, before any read."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 18, 1 << 20], "data_offsets": [0, 1 << 40]}}).encode()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8,
                                                    "num_attention_heads": 2, "num_hidden_layers": 1,
                                                    "intermediate_size": 8, "vocab_size": 8}))
    one_line_error(folder, "past the end of the file")
