"""Tiny random checkpoints (HF and GGUF) of every supported family, and checks on them (test-only helper).

    path = make_tiny_checkpoint("qwen3", tmp_path / "qwen3")     # config.json, model.safetensors,
                                                                 # tokenizer.json, tokenizer_config.json
Overrides are config fields (``num_key_value_heads=1``), plus three recognised extras:
``dtype="bfloat16"`` saves in that dtype, ``max_shard_size="20KB"`` shards the safetensors,
``seed=1`` changes the random weights (default 0). The tokenizer is a byte-level BPE trained on a
small built-in corpus to exactly ``vocab_size`` tokens, ids 0..2 = <|endoftext|>, <|im_start|>, <|im_end|>.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, intermediate_size=128, max_position_embeddings=1024, rms_norm_eps=1e-5,
             bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "llama3": dict(model_type="llama", num_key_value_heads=4, head_dim=32, eos_token_id=[2, 0],
                   max_position_embeddings=16384,
                   rope_scaling=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=1, sliding_window=64),
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=4, head_dim=32),
    "phi3": dict(model_type="phi3", num_key_value_heads=4, head_dim=None, partial_rotary_factor=0.5,
                 original_max_position_embeddings=1024),
    # a window of 4 so prompts and decode steps cross it; one sliding and one full layer, two RoPE bases,
    # a softmax scale that is not 1/sqrt(head_dim)
    "gemma3": dict(model_type="gemma3_text", tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # small caps, so that soft-capping changes the tiny model's scores and logits; untied head
    "gemma2": dict(model_type="gemma2", sliding_window=4, query_pre_attn_scalar=32, attn_logit_softcapping=0.5,
                   final_logit_softcapping=0.5, layer_types=["sliding_attention", "full_attention"]),
    # layer 3 without RoPE (no_rope_layer_interval 4, llama.cpp's fixed rule), tied embeddings as SmolLM3-3B
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 2000000.0}),
    # mixture of experts: 8 experts, top-2 renormalised, layer 1 dense (mlp_only_layers), experts 32 wide
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    # attention sinks, sliding window 4 / full, YaRN, biases everywhere, 8 clamped experts top-2
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                    attention_bias=True, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
}
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")  # their own tests (tests/families/test_moe.py): experts have no GGUF writer here yet
FAMILIES = tuple(f for f in CONFIGS if f not in MOE_FAMILIES)
# Hybrid models (per-layer state beyond K/V: models/spec.py LAYER_KINDS). Kept apart from CONFIGS: the generic
# tests over FAMILIES read llama-shaped modules and write GGUFs; each hybrid has its own test file.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    # every layer kind, conv first; a kernel of 4 (state 3) so prompts and decode steps cross the window;
    # the MLP width rule of Lfm2MLP (2/3, a multiplier, rounded up to a multiple) exercised
    "lfm2": dict(model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                 conv_L_cache=4, head_dim=None, tie_word_embeddings=True, intermediate_size=192,
                 block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32),
    # Gated DeltaNet and gated full attention; 2 key heads serving 4 value heads, Dk != Dv, a conv of 4 taps,
    # RoPE on a quarter of each 32-dim head (8 dims), untied head
    "qwen3_5": dict(model_type="qwen3_5_text", num_hidden_layers=3, head_dim=32,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    # Mamba2 blocks (one straight after another), an attention block and ReLU² MLP blocks; 4 heads of 8 in 2 groups
    # of B/C (state 16), a conv of 4 taps; a chunk of 16 so transformers' chunked scan crosses chunks
    "nemotron_h": dict(model_type="nemotron_h", hybrid_override_pattern="MM*-M-", num_hidden_layers=None,
                       mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4,
                       chunk_size=16, layer_norm_epsilon=1e-5, rms_norm_eps=None, mlp_hidden_act="relu2"),
    # Mamba2, attention, Mamba2 (8 heads of 16, 2 groups, state 16), each with the shared SwiGLU MLP and no experts
    # (num_local_experts=4 makes the MoE variant); every Granite multiplier away from 1; no RoPE (as Granite 4.0-H)
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                             mamba_chunk_size=16, shared_intermediate_size=96, intermediate_size=32,
                             num_local_experts=0, num_experts_per_tok=2, embedding_multiplier=3.0,
                             residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0,
                             position_embedding_type=None),
}
HYBRIDS = tuple(HYBRID_CONFIGS)
# Families with their own test file only (no GGUF writer, layouts the generic runners do not read).
OWN_CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma 4 text, E2B-shaped: per-layer inputs (8 wide), the last 2 of 5 layers read the K/V of the last
    # earlier layer of their kind (3 -> 1 sliding, 4 -> 2 full) and have double-wide MLPs, window 4, full layers
    # with heads twice as wide (global_head_dim 32: their caches too),
    # proportional RoPE on a quarter of the full layers' angles, v norm, a final soft-cap that bites
    "gemma4": dict(model_type="gemma4_text", num_hidden_layers=5, intermediate_size=64, tie_word_embeddings=True,
                   global_head_dim=32, sliding_window=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                   num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=2.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1000000.0}}),
}
# Weights scaled up after randomising, by name suffix: at the uniform 0.05 scale a conv layer's state
# hardly moves a greedy token, so a state bug (a slot moved without its state) would pass unseen.
SCALES: dict[str, dict[str, float]] = {"lfm2": {"conv.conv.weight": 20.0, "conv.in_proj.weight": 4.0}}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = """The quick brown fox jumps over the lazy dog. Hello world! How are you today?
A decoder-only transformer predicts the next token from the tokens before it.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * 2)
Numbers like 12, 345 and 6789 appear in text; so do dates such as 2024-05-17.
The cache keeps keys and values of earlier positions so each step only computes one token.
Once upon a time there was a small model that wanted to speak many languages: bonjour, hola, hallo.
"""


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The config.json fields of a tiny `family` model (before transformers fills defaults)."""
    known = {**CONFIGS, **HYBRID_CONFIGS, **OWN_CONFIGS}
    if family not in known:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES + HYBRIDS}")
    config = {**_BASE, **known[family], **overrides}
    return {k: v for k, v in config.items() if v is not None}


def make_tokenizer(vocab_size: int, special: Sequence[str] = (), text: str = "", added: Sequence[str] = ()) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` tokens: trained on the corpus and `text`,
    with the ChatML specials and a model's own `special` ones, then the non-special `added` tokens and fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(special),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS + text] * 4, trainer)
    if added:
        tok.add_tokens(list(added))
    filler = [f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_tokens(filler)  # a small corpus may run out of merges before vocab_size
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def save_chatml_tokenizer(tok: Any, path: Path, chat_template: str, **extra_special_tokens: str) -> None:
    """tokenizer.json and a tokenizer_config.json for a ChatML model (no BOS, <|im_end|> ends a turn) with its
    chat template and, where given, its named special tokens (``audio_token="<|AUDIO|>"``...)."""
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                              "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": chat_template}
    if extra_special_tokens:
        config["extra_special_tokens"] = extra_special_tokens
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _randomise(model: Any, seed: int) -> None:
    """Every parameter random (biases and norms too, so tests see them), reproducibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scalar (a buffer, 1 at init)
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def make_tiny_checkpoint(family: str, path: str | Path, **overrides: Any) -> Path:
    """Write a tiny random HF checkpoint of `family` (see FAMILIES) to `path` and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = overrides.pop("dtype", None)
    shard = overrides.pop("max_shard_size", None)
    seed = overrides.pop("seed", 0)
    fields = tiny_config(family, **overrides)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            for suffix, factor in SCALES.get(family, {}).items():
                if name.endswith(suffix):
                    p.mul_(factor)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    make_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                  "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
                  "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


# -- GGUF ---------------------------------------------------------------------------------------------

GGUF_ARCH = {"llama": "llama", "llama3": "llama", "llama_tied": "llama", "mistral": "llama",  # as llama.cpp
             "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3", "gemma2": "gemma2",
             "qwen3_moe": "qwen3moe", "smollm3": "smollm3", "gpt_oss": "gpt-oss"}
# HF key suffix -> GGUF tensor suffix, the way llama.cpp's converter names them.
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # MoE router; the experts are stacked by _stack_experts
}
# Gemma's four norms per layer (llama.cpp's tensor_mapping: ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM).
_GGUF_NAMES_GEMMA = {**_GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def _gguf_name(key: str, arch: str) -> str:
    if key in _GGUF_TOP:
        return _GGUF_TOP[key]
    _, _, layer, rest = key.split(".", 3)  # model.layers.{i}.<rest>
    return f"blk.{layer}.{(_GGUF_NAMES_GEMMA if arch.startswith('gemma') else _GGUF_NAMES)[rest]}"


def _gguf_gemma_meta(writer: Any, cfg: dict) -> None:
    """What llama.cpp's Gemma converters store, plus the keys it leaves to fixed rules (pattern, local
    base, softmax scale) written out, since a 2-layer model does not follow those rules."""
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["query_pre_attn_scalar"] != head_dim:
        writer.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if local:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            writer.add_float32(f"{writer.arch}.{key}", cfg[key])


def _interleave_rows(w: Any, n_head: int) -> Any:
    """llama.cpp's q/k row permutation for its interleaved RoPE (rotate-half -> pairs)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tokenizer_meta(writer: Any, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_model_meta(writer: Any, arch: str, cfg: dict) -> None:
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("rope.dimension_count", int(head_dim * prf)), ("vocab_size", cfg["vocab_size"])):
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    full = rope.get("full_attention") or rope  # Gemma 3: per-layer-type rope_parameters
    writer.add_float32(f"{arch}.rope.freq_base", full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch.startswith("gemma"):
        _gguf_gemma_meta(writer, cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 saves the latter
    if experts:
        for key, value in (("expert_count", experts), ("expert_used_count", cfg["num_experts_per_tok"]),
                           ("expert_feed_forward_length", cfg.get("moe_intermediate_size") or cfg["intermediate_size"])):
            writer.add_uint32(f"{arch}.{key}", int(value))
    if arch == "gpt-oss":  # what llama.cpp's converter stores (the layer pattern and SwiGLU constants are fixed rules)
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", cfg["rope_parameters"]["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          cfg["rope_parameters"]["original_max_position_embeddings"])


def _stack_experts(tensors: dict, arch: str) -> dict:
    """Per-expert HF tensors -> llama.cpp's stacked blk.{i}.ffn_{gate,up,down}_exps [E, ...] (HF names kept);
    gpt-oss's stacked [in, out] experts and its other tensors as llama.cpp's converter names them."""
    import re

    import numpy as np

    out, stacks = {}, {}
    gpt_oss = {"self_attn.sinks": "attn_sinks.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
               "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
               "self_attn.o_proj.bias": "attn_output.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    for key, w in tensors.items():
        g = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key) if arch == "gpt-oss" else None
        if g and g.group(2) in gpt_oss:
            out[f"blk.{g.group(1)}.{gpt_oss[g.group(2)]}"] = w
            continue
        if g and g.group(2).startswith("mlp.experts."):  # gpt-oss: [E, in, out], gate/up interleaved
            name = g.group(2).removeprefix("mlp.experts.")
            b = f"blk.{g.group(1)}."
            if name == "gate_up_proj":
                t = np.ascontiguousarray(w.transpose(0, 2, 1))
                out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = t[:, 0::2].copy(), t[:, 1::2].copy()
            elif name == "gate_up_proj_bias":
                out[b + "ffn_gate_exps.bias"], out[b + "ffn_up_exps.bias"] = w[:, 0::2].copy(), w[:, 1::2].copy()
            elif name == "down_proj":
                out[b + "ffn_down_exps.weight"] = np.ascontiguousarray(w.transpose(0, 2, 1))
            else:
                raise ValueError(f"no GGUF name for {key}")
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", key)
        if m is None:
            out[key] = w
        else:
            stacks.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w
    for (layer, part), experts in stacks.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([experts[j] for j in sorted(experts)])
    return out


def _rope_freqs(cfg: dict) -> Any:
    """llama3 scaling as llama.cpp stores it: per-frequency divisors (rope_freqs.weight)."""
    from decodert.models.common import hf_rope

    rope = hf_rope(cfg)
    plain = type(rope)(theta=rope.theta)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (plain.inv_freq(head_dim) / rope.inv_freq(head_dim)).astype("float32")


def gguf_meta(arch: str, **extra) -> dict:
    """GGUF metadata of a tiny llama-shaped `arch` model (what spec_from_gguf reads); ``extra`` keys are relative to
    the arch."""
    import numpy as np

    meta = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.context_length": 2048,
            f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.rope.freq_base": np.float32(10000.0),
            f"{arch}.attention.layer_norm_rms_epsilon": np.float32(1e-5), f"{arch}.vocab_size": 512,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7}
    meta.update({f"{arch}.{k}": v for k, v in extra.items()})  # extra keys are relative to the arch
    return meta


def mamba2_llama_cpp_layout(key: str, w: Any, cfg: dict) -> Any:
    """What llama.cpp's converter (Mamba2 / NemotronH models) does to a tensor: A_log -> -exp(A_log) [H, 1],
    D [H, 1], the conv squeezed [C, K], the gated norm [G, Di/G]."""
    import numpy as np

    if key.endswith("A_log"):
        return -np.exp(w)[:, None]
    if key.endswith((".mixer.D", ".mamba.D")):
        return w[:, None]
    if key.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], -1)
    if key.endswith((".mixer.norm.weight", ".mamba.norm.weight")):
        return w.reshape(cfg["n_groups"], -1)
    return w


def make_tiny_gguf(family: str, path: str | Path, qtype: str = "F32", raw: dict | None = None,
                   drop: tuple = (), meta: dict | None = None, hf_dir: Path | None = None, **overrides: Any) -> Path:
    """A tiny GGUF of `family` converted from make_tiny_checkpoint's weights, llama.cpp style.

    `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1) applies to 2-D weights; norms stay F32.
    `raw` maps GGUF tensor names to (qtype_name, uint8 bytes) written as-is; `drop` leaves tensors out;
    `meta` adds metadata keys (float -> float32, int -> uint32, str -> string); `hf_dir`: convert that
    tiny HF checkpoint of `family` (one the ``tiny_checkpoint`` fixture made) instead of making one.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    path = Path(path)
    hf_dir = hf_dir or make_tiny_checkpoint(family, path.with_suffix(".hf"), **overrides)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    _gguf_model_meta(writer, arch, cfg)
    _gguf_tokenizer_meta(writer, hf_dir)
    for key, value in (meta or {}).items():
        add = {float: writer.add_float32, int: writer.add_uint32, str: writer.add_string}[type(value)]
        add(key, value)
    qt = gguf.GGMLQuantizationType[qtype]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    for key, w in _stack_experts(load_file(hf_dir / "model.safetensors"), arch).items():
        name = key if key.startswith("blk.") else _gguf_name(key, arch)
        if name in drop:
            continue
        if arch in ("llama", "smollm3") and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _interleave_rows(w, heads if "attn_q" in name else kv)
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) norm factor
        if raw and name in raw:
            kind, data = raw[name]
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif w.ndim in (2, 3) and qt != gguf.GGMLQuantizationType.F32 and not name.endswith(".bias"):
            writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)  # uint8 rows: byte shape
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    if (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- assertions shared by the checkpoint tests ----------------------------------------------------------


def torch_weights(model, spec) -> dict:
    """Canonical name -> np.float32, read from a transformers model's modules (not its state-dict keys)."""
    import numpy as np
    import torch

    def arr(*ts):
        return torch.cat([t.detach().float() for t in ts], 0).numpy()

    m = model.model
    shift = 1.0 if type(m.norm).__name__.startswith("Gemma") else 0.0  # Gemma's norm multiplies by 1 + w

    def norm(module):
        return arr(module.weight) + np.float32(shift)

    out = {"embed": arr(m.embed_tokens.weight), "final_norm": norm(m.norm)}
    if not spec.tie_word_embeddings:
        out["lm_head"] = arr(model.lm_head.weight)
    for i, layer in enumerate(m.layers):
        a, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}."
        out[p + "input_norm"] = norm(layer.input_layernorm)
        if spec.sandwich_norm:
            out[p + "attn_out_norm"] = norm(layer.post_attention_layernorm)
            out[p + "post_norm"] = norm(layer.pre_feedforward_layernorm)
            out[p + "mlp_out_norm"] = norm(layer.post_feedforward_layernorm)
        else:
            out[p + "post_norm"] = norm(layer.post_attention_layernorm)
        out[p + "o"] = arr(a.o_proj.weight)
        out[p + "down"] = arr(mlp.down_proj.weight)
        if hasattr(a, "qkv_proj"):
            out[p + "qkv"] = arr(a.qkv_proj.weight)
        else:
            out[p + "qkv"] = arr(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        if spec.attention.qkv_bias:
            out[p + "qkv_bias"] = arr(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        if spec.attention.qk_norm:
            out[p + "q_norm"], out[p + "k_norm"] = norm(a.q_norm), norm(a.k_norm)
        out[p + "gate_up"] = (arr(mlp.gate_up_proj.weight) if hasattr(mlp, "gate_up_proj")
                              else arr(mlp.gate_proj.weight, mlp.up_proj.weight))
    return out


def load_torch(path):
    """The transformers model of an HF folder, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def make_adapter(base, path, r, alpha, targets, seed, scale=0.1, **extra):
    """A PEFT adapter of ``base`` with random (non-zero) A and B, saved as PEFT writes it."""
    import peft
    import torch

    model = load_torch(base)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(path)
    return path


def assert_matches(ckpt, expected, atol=0.0):
    """Every canonical tensor of `ckpt`: float32, canonical shape, fresh and equal to expected[name]."""
    import numpy as np

    from decodert.models.canonical import canonical_shape

    assert set(ckpt.names()) == set(expected)
    for name in ckpt.names():
        w = ckpt.tensor(name)
        assert w.dtype == np.float32 and w.shape == canonical_shape(ckpt.spec, name), name
        assert w.flags.c_contiguous and w.flags.writeable
        np.testing.assert_allclose(w, expected[name], atol=atol, rtol=0, err_msg=name)


def one_line_error(path, match) -> str:
    """open_checkpoint(path) raises a one-line DecodertError containing `match`; returns the message."""
    import pytest

    from decodert.errors import DecodertError
    from decodert.export.checkpoints.checkpoint_open import open_checkpoint

    with pytest.raises(DecodertError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    return msg
