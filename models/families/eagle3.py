"""EAGLE-3 draft heads (Llama-3 / Qwen3 / SmolLM2 targets): one Llama decoder layer that drafts the target's next
tokens from three of the target's layer features, with a small K/V of its own (export/heads/eagle3.py builds its
graph, runtime/speculation/mtp.py runs it as it runs the Qwen3.5 MTP layer).

    config.json  architectures [LlamaForCausalLMEagle3] (model_type is "llama": the head is found by its
                 architecture), hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                 head_dim (else hidden / heads), rms_norm_eps, rope_theta / rope_scaling, vocab_size (the target's),
                 draft_vocab_size (else vocab_size), target_hidden_size (else hidden_size), and the target layers
                 read: eagle_aux_hidden_state_layer_ids, top level or in eagle_config (else (2, N // 2, N - 3) of
                 the target's N layers)

The features (the target's graphs return them when exported with ``--hidden-states eagle3``,
export/lowering/io_contract.hidden_outputs): the *input* of each of the three target layers (the residual stream
before the layer runs: vLLM's and SGLang's ``hidden_states + residual`` before layer idx, transformers'
``hidden_states[idx]``), concatenated low, mid, high: f [3 target_hidden]. One step for the pair (f_p or the head's
own g_p, the token t at p + 1) at RoPE position p, every RMSNorm x w (Llama's):

    x      = fc(f_p)  (first step of a run: [3 target_hidden] -> [hidden])  |  g_p (a chained step: already [hidden])
    a      = attention([input_layernorm(embed(t)), hidden_norm(x)])   q/k/v read [2 hidden]; plain RoPE at p,
             GQA over the head's own K/V of earlier positions, o_proj -> [hidden]
    r      = x + a   (norm_before_residual: hidden_norm(x) + a)
    g      = r + mlp(post_attention_layernorm(r))                      the pre-norm output: the next step's g
    logits = lm_head(norm(g))                                          [draft_vocab]
    token  = argmax + d2t[argmax]                                      the target's id (d2t: draft id -> offset)

``embed_tokens`` may be absent (the target's embedding is used, rows of its weights.bin); ``t2d`` (target id ->
whether the draft vocabulary has it) is read but not needed: d2t maps every draft id to its target id. No
transformers reference exists for the layer: tests/families/test_eagle3.py has a torch one written from this
definition.
"""

from __future__ import annotations

import dataclasses

from decodert.errors import DecodertError
from decodert.models.common import hf_rope
from decodert.models.rope import RopeSpec

MODEL_TYPES = ("eagle3",)  # a name of its own for the registry; checkpoints say model_type llama (ARCHITECTURES)
ARCHITECTURES = ("LlamaForCausalLMEagle3",)

_M = "midlayer."
HF_WEIGHTS: dict[str, str] = {  # canonical name -> the published heads' key
    "fc": "fc.weight",  # [hidden, 3 target_hidden]: low, mid, high features' columns
    "embed_norm": _M + "input_layernorm.weight",
    "hidden_norm": _M + "hidden_norm.weight",
    "q": _M + "self_attn.q_proj.weight",  # [H D, 2 hidden]: embedding columns first
    "k": _M + "self_attn.k_proj.weight",
    "v": _M + "self_attn.v_proj.weight",
    "o": _M + "self_attn.o_proj.weight",
    "post_norm": _M + "post_attention_layernorm.weight",
    "gate": _M + "mlp.gate_proj.weight",
    "up": _M + "mlp.up_proj.weight",
    "down": _M + "mlp.down_proj.weight",
    "final_norm": "norm.weight",
    "lm_head": "lm_head.weight",  # [draft_vocab, hidden]
    "d2t": "d2t",  # [draft_vocab] int64: target id - draft id
    "t2d": "t2d",  # [vocab] bool
    "embed": "embed_tokens.weight",  # optional: the target's embedding otherwise
}
OPTIONAL = ("embed", "d2t", "t2d")  # a head over the whole vocabulary may leave out d2t / t2d


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
    """What the head's graph needs."""

    hidden_size: int
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    layer_ids: tuple[int, ...] | None  # the config's; None: the default for the target's layer count
    norm_before_residual: bool = False


def is_eagle3(config: dict) -> bool:
    """Whether a config.json is an EAGLE-3 head's."""
    return config.get("model_type") in MODEL_TYPES or any(a in ARCHITECTURES for a in config.get("architectures") or ())


def spec_from_hf(config: dict) -> Eagle3Spec:
    """The head's spec from its config.json; what it cannot be is refused in one line naming it."""
    if not is_eagle3(config):
        raise DecodertError(f"an EAGLE-3 head's config.json names architectures {list(ARCHITECTURES)}")
    layers = int(config.get("num_hidden_layers", 1))
    if layers != 1:
        raise DecodertError(f"eagle3: num_hidden_layers {layers} is not supported (one decoder layer)")
    if str(config.get("hidden_act", "silu")) != "silu":
        raise DecodertError(f"eagle3: hidden_act {config.get('hidden_act')!r} is not supported (silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise DecodertError("eagle3: attention_bias / mlp_bias are not supported")
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    ids = config.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None and (not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids)):
        raise DecodertError(f"eagle3: eagle_aux_hidden_state_layer_ids must be three layer indices, got {ids!r}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    vocab = int(config["vocab_size"])
    return Eagle3Spec(
        hidden_size=hidden, target_hidden_size=int(config.get("target_hidden_size") or hidden), vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope=hf_rope(config),
        layer_ids=tuple(ids) if ids is not None else None,
        norm_before_residual=bool(config.get("norm_before_residual", False)))


def layer_ids(spec: Eagle3Spec, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the config's, else (2, N // 2, N - 3); refused in one line
    where one is not a layer of the target."""
    ids = spec.layer_ids or (2, target_layers // 2, target_layers - 3)
    if not all(0 <= i < target_layers for i in ids):
        raise DecodertError(f"eagle3: the head reads the target's layers {list(ids)}; the target has {target_layers}")
    return tuple(ids)


def weight_names(keys: set[str]) -> dict[str, str]:
    """Canonical name -> checkpoint key of every tensor the head has (the optional ones where present); a missing
    required one refused in one line."""
    names = {}
    for canon, key in HF_WEIGHTS.items():
        if key in keys:
            names[canon] = key
        elif canon not in OPTIONAL:
            raise DecodertError(f"eagle3: weight {key} is missing")
    return names
