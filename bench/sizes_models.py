"""The checkpoints of bench/sizes.py: random weights at real shapes, one HF folder per shape, and the
GGUF files llama.cpp runs, all written once into a cache folder and reused.

- ``SHAPES``: hand-written configs from the published shapes of Qwen3-0.6B, Llama-3.2-1B and
  Qwen3-4B (plus ``tiny`` for the smoke test). Speed does not depend on the weight values, so
  random weights are fair for speed (not for quality or speculation). ``smollm2`` is the one real
  checkpoint: the HF folder transformers writes from the SmolLM2 GGUF fixture (bench/competitors.py).
- ``hf_checkpoint``: ``AutoModelForCausalLM.from_config`` + ``save_pretrained`` (bf16 where the
  shape asks for it, to bound the memory), and a tokenizer: SmolLM2's (from the GGUF fixture)
  with its vocabulary padded to the shape's size by tokens no merge produces.
- ``gguf_from_hf``: an F16 or a Q4_0 GGUF of the same weights, written with the ``gguf`` package
  (llama arch: q/k rows permuted to llama.cpp's interleaved rotary, as its converter does; llama3
  rope scaling as ``rope_freqs``). decodert transcodes the Q4_0 file exactly, so llama.cpp and
  decodert run bit-identical weights from it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from competitors import finish_gguf

GGUF_MOSTLY_F16, GGUF_MOSTLY_Q4_0 = 1, 2  # general.file_type

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 40960, "vocab_size": 151936, "tie_word_embeddings": True,
          "attention_bias": False, "head_dim": 128, "num_key_value_heads": 8, "bos_token_id": 151643,
          "eos_token_id": 151645}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16},
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                     "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
                     "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
                     "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
                     "bos_token_id": 128000, "eos_token_id": 128001,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "dtype": "bfloat16"},  # 16 GB in fp32: stored bf16
    "smollm2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True},
    "tiny": {**_QWEN3, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2},
}


def params(shape: dict[str, Any]) -> int:
    """Parameter count (tied head counted once)."""
    h, i, n, d = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["head_dim"]
    attn = h * d * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    return shape["vocab_size"] * h + n * (attn + 3 * h * i)


def hf_checkpoint(name: str, cache: Path, tokenizer_gguf: Path) -> Path:
    """The HF folder of shape ``name`` under ``cache`` (written once; seed 0)."""
    folder = cache / name
    if (folder / "config.json").is_file():
        return folder
    if name == "smollm2":  # the real weights, not a random draw at its shape
        from competitors import make_hf_folder

        return make_hf_folder(tokenizer_gguf, folder)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    dtype = getattr(torch, shape.pop("dtype", "float32"))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(tmp)
    del model
    padded_tokenizer(tokenizer_gguf, cache / "tokenizer-smollm2", shape["vocab_size"], tmp)
    tmp.rename(folder)
    return folder


def padded_tokenizer(gguf_path: Path, base: Path, vocab: int, out: Path) -> None:
    """SmolLM2's tokenizer files (kept once in ``base``) with ``vocab`` ids: extra tokens pad the BPE vocab."""
    if not (base / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(base)
    for f in base.iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, out / f.name)
    tok = json.loads((base / "tokenizer.json").read_text())
    table = tok["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(vocab):
        if i not in taken:
            table[f"<|pad_{i}|>"] = i
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


# ---- GGUF ----------------------------------------------------------------------------------------
def gguf_from_hf(folder: Path, dst: Path, kind: str, tokenizer_gguf: Path) -> Path:
    """``kind`` F16 | Q4_0: the folder's weights as a llama.cpp GGUF (matrices in ``kind``, norms F32)."""
    if dst.is_file():
        return dst
    import gguf
    from safetensors import safe_open

    config = _rope_keys(json.loads((folder / "config.json").read_text()))
    arch = config["model_type"]
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _metadata(writer, config, GGUF_MOSTLY_F16 if kind == "F16" else GGUF_MOSTLY_Q4_0)
    _tokenizer_fields(writer, tokenizer_gguf, config["vocab_size"])
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config["num_hidden_layers"])
    if config.get("rope_scaling"):
        writer.add_tensor("rope_freqs.weight", llama3_freq_factors(config))
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                w = f.get_tensor(key).float().numpy()
                _add(writer, names.get_name(key, try_suffixes=(".weight", ".bias")), _permuted(w, key, config), kind)
    return finish_gguf(writer, tmp, dst)


def _rope_keys(config: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; 4.x ``rope_theta`` + ``rope_scaling``: the latter here."""
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "llama3":
        config.setdefault("rope_scaling", rope)
    return config


def _add(writer: Any, name: str, w: np.ndarray, kind: str) -> None:
    import gguf

    if w.ndim == 1:
        writer.add_tensor(name, w.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(name, w.astype(np.float16))
    else:
        q4 = gguf.GGMLQuantizationType.Q4_0
        raw = gguf.quants.quantize(w, q4)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=q4)


def _permuted(w: np.ndarray, key: str, config: dict) -> np.ndarray:
    """llama arch: q/k rows from HF's half-split rotary order to GGUF's interleaved pairs."""
    if config["model_type"] != "llama" or not key.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    heads = config["num_attention_heads"] if "q_proj" in key else config["num_key_value_heads"]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(config: dict) -> np.ndarray:
    """Llama 3.1+ rope scaling as per-frequency divisors [head_dim / 2] (GGUF ``rope_freqs``)."""
    r, d = config["rope_scaling"], config["head_dim"]
    low_wl = r["original_max_position_embeddings"] / r["low_freq_factor"]
    high_wl = r["original_max_position_embeddings"] / r["high_freq_factor"]
    out = []
    for j in range(0, d, 2):
        wavelen = 2 * math.pi * config["rope_theta"] ** (j / d)
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(r["factor"])
        else:
            smooth = (r["original_max_position_embeddings"] / wavelen - r["low_freq_factor"]) / (
                r["high_freq_factor"] - r["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / r["factor"] + smooth))
    return np.asarray(out, np.float32)


def _metadata(writer: Any, c: dict, file_type: int) -> None:
    writer.add_name(f"random {c['model_type']} {c['num_hidden_layers']}x{c['hidden_size']}")
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_file_type(file_type)


def _tokenizer_fields(writer: Any, gguf_path: Path, vocab: int) -> None:
    """The fixture's tokenizer.* fields, its token list padded to ``vocab`` entries."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"<|pad_{i}|>" for i in range(len(value), vocab)]
        elif key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = list(value) + [1 if key.endswith("type") else 0.0] * (vocab - len(value))  # 1: normal
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
