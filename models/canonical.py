"""Canonical weights: the names and shapes the graph recipe reads, for any ModelSpec.

Every family's checkpoint reader maps its keys onto these (models/families/<family>.py tables); the export writes
them to weights.bin in this order and checks each tensor's shape against ``canonical_shape``.
"""

from __future__ import annotations

from decodert.errors import DecodertError
from decodert.models.spec import ModelSpec


def canonical_names(spec: ModelSpec) -> list[str]:
    """Canonical weight names, in the order they are written to weights.bin.

    Layout is the checkpoint's [out_features, in_features] for every linear weight.

    - ``embed``                     [V, hidden]
    - ``layers.{i}.input_norm``     [hidden]                     the norm in front of the layer's mixer
    - the mixer's weights (``MIXER_NAMES`` by ``spec.layer_kind(i)``); an "attention" layer's:
      - ``layers.{i}.qkv``          [(H + 2 H_kv) * D, hidden]   rows: q heads, k heads, v heads
      - ``layers.{i}.qkv_bias``     [(H + 2 H_kv) * D]           (qkv_bias only)
      - ``layers.{i}.q_norm``       [D]                          (qk_norm only)
      - ``layers.{i}.k_norm``       [D]                          (qk_norm only)
      - ``layers.{i}.o``            [hidden, H * D]
      - ``layers.{i}.o_bias``       [hidden]                     (o_bias only)
      - ``layers.{i}.sinks``        [H]                          (attn_sinks only: each head's sink logit)
      a "conv" layer's (LFM2's gated short conv, C = hidden):
      - ``layers.{i}.conv_in``      [3 C, hidden]                rows: B gate, C gate, x (+ ``conv_in_bias`` [3 C])
      - ``layers.{i}.conv``         [C, 1, K]                    depthwise taps, ONNX Conv layout (+ ``conv_bias`` [C])
      - ``layers.{i}.conv_out``     [hidden, C]                  (+ ``conv_out_bias`` [hidden])
      a "linear_attention" layer's (Qwen3.5's Gated DeltaNet; Kd = Hk Dk, Vd = Hv Dv, C = 2 Kd + Vd):
      - ``layers.{i}.linear_in``    [C + Vd + 2 Hv, hidden]      rows: q, k, v (the conv's channels), z, b, a
      - ``layers.{i}.linear_conv``  [C, 1, K]                    depthwise taps
      - ``layers.{i}.linear_a_log`` [Hv], ``linear_dt_bias`` [Hv]  decay parameters
      - ``layers.{i}.linear_norm``  [Dv]                         the gated RMSNorm (plain w)
      - ``layers.{i}.linear_out``   [hidden, Vd]
      a "mamba2" layer's (Nemotron-H / Granite 4.0-H; Di = H Dh, C = Di + 2 G N):
      - ``layers.{i}.mamba_in``     [Di + C + H, hidden]         rows: z (the gate), x, B, C (the conv's), dt
      - ``layers.{i}.mamba_conv``   [C, 1, K]                    depthwise taps (+ ``mamba_conv_bias`` [C], conv_bias)
      - ``layers.{i}.mamba_a_log`` [H], ``mamba_dt_bias`` [H], ``mamba_d`` [H]   A = -exp(a_log), dt bias, D skip
      - ``layers.{i}.mamba_norm``   [Di]                         the gated RMSNorm over G groups (plain w)
      - ``layers.{i}.mamba_out``    [hidden, Di]
      a "none" layer has no input_norm and no mixer weights (it is its MLP alone)
      with attn_output_gate, ``qkv`` rows are q heads, gate heads, k heads, v heads
    - ``layers.{i}.attn_out_norm``  [hidden]                     (sandwich_norm only: on the mixer's output)
    - ``layers.{i}.post_norm``      [hidden]                     the norm in front of the MLP
    - ``layers.{i}.gate_up``        [2 * I, hidden]              rows: gate, then up (``up`` [I, hidden] when not
                                                                 gated_mlp); no post_norm nor MLP where mlp_types is "none"
    - ``layers.{i}.down``           [hidden, I]
      or, in a MoE layer (spec.is_moe(i); Ie = expert_intermediate_size, E = num_experts):
    - ``layers.{i}.router``         [E, hidden]                  router logits = h @ router^T
    - ``layers.{i}.experts.gate_up`` [E, 2 * Ie, hidden]         rows interleaved: gate 0, up 0, gate 1, ...
    - ``layers.{i}.experts.down``   [E, hidden, Ie]
    - ``layers.{i}.router_bias`` [E], ``experts.gate_up_bias`` [E, 2 Ie] (interleaved), ``experts.down_bias``
      [E, hidden]                                                (router_bias / expert_bias only)
    - ``layers.{i}.gate_up``, ``layers.{i}.down``               (shared_mlp only: the dense MLP beside the experts)
    - ``layers.{i}.shared_gate`` [1, hidden]                       (shared_mlp_gate only: sigmoid(h @ it^T) scales that MLP)
    - ``layers.{i}.mlp_out_norm``   [hidden]                     (sandwich_norm only: on the MLP output)
    - ``final_norm``                [hidden]
    - ``lm_head``                   [V, hidden]                  (absent when tied)

    Gemma 4 (E2B/E4B): a layer that reads another layer's K/V (``spec.kv_source(i) != i``) has ``layers.{i}.q``
    [H * D, hidden] (and ``q_norm``) instead of ``qkv`` / ``k_norm``; ``layers.{i}.gate_up`` / ``down`` are
    ``spec.mlp_size(i)`` wide. Per-layer inputs (``per_layer_input_size`` P, L layers) add, after ``embed``,
    ``embed_per_layer`` [Vp, L * P], ``per_layer_model_proj`` [L * P, hidden], ``per_layer_proj_norm`` [P], and per
    layer, after the MLP's weights, ``layers.{i}.ple_gate`` [P, hidden], ``ple_proj`` [hidden, P], ``ple_norm``
    [hidden]; ``layers.{i}.layer_scalar`` [1] closes each layer with ``layer_scalar``.
    """
    names = ["embed"]
    if spec.per_layer_input_size:
        names += ["embed_per_layer", "per_layer_model_proj", "per_layer_proj_norm"]
    for i in range(spec.num_layers):
        names += [f"layers.{i}.{leaf}" for leaf in _layer_leaves(spec, i)]
    names.append("final_norm")
    if not spec.tie_word_embeddings:
        names.append("lm_head")
    return names


def _layer_leaves(spec: ModelSpec, i: int) -> list[str]:
    """Layer ``i``'s weight names after ``layers.{i}.``, in canonical_names' order."""
    leaves: list[str] = []
    if spec.has_mixer(i):
        leaves += ["input_norm", *mixer_names(spec, i)]
        if spec.kv_source(i) != i:  # a layer reading another's K/V projects q only
            leaves = ["q" if leaf == "qkv" else leaf for leaf in leaves if leaf != "k_norm"]
        leaves += ["attn_out_norm"] if spec.sandwich_norm else []
    if spec.has_mlp(i):
        leaves.append("post_norm")
        if not spec.is_moe(i):
            leaves += ["gate_up" if spec.gated_mlp else "up", "down"]
        else:
            leaves += ["router"] + (["router_bias"] if spec.router_bias else []) + ["experts.gate_up"]
            leaves += ["experts.gate_up_bias"] if spec.expert_bias else []
            leaves += ["experts.down"] + (["experts.down_bias"] if spec.expert_bias else [])
            leaves += ["gate_up", "down"] if spec.shared_mlp else []
            leaves += ["shared_gate"] if spec.shared_mlp_gate else []
        leaves += ["mlp_out_norm"] if spec.sandwich_norm else []
    if spec.per_layer_input_size:
        leaves += ["ple_gate", "ple_proj", "ple_norm"]
    if spec.layer_scalar:
        leaves.append("layer_scalar")
    return leaves


def _attention_names(spec: ModelSpec) -> list[str]:
    return ["qkv", *(["qkv_bias"] if spec.qkv_bias else []), *(["q_norm", "k_norm"] if spec.qk_norm else []), "o",
            *(["o_bias"] if spec.o_bias else []), *(["sinks"] if spec.attn_sinks else [])]


def _conv_names(spec: ModelSpec) -> list[str]:
    if spec.conv_bias:
        return ["conv_in", "conv_in_bias", "conv", "conv_bias", "conv_out", "conv_out_bias"]
    return ["conv_in", "conv", "conv_out"]


def _delta_net_names(spec: ModelSpec) -> list[str]:
    return ["linear_in", "linear_conv", "linear_a_log", "linear_dt_bias", "linear_norm", "linear_out"]


def _mamba2_names(spec: ModelSpec) -> list[str]:
    return ["mamba_in", "mamba_conv", *(["mamba_conv_bias"] if spec.conv_bias else []), "mamba_a_log", "mamba_dt_bias",
            "mamba_d", "mamba_norm", "mamba_out"]


# layer kind -> the leaf names of its mixer's weights (a kind without an entry has no lowering yet)
MIXER_NAMES = {"attention": _attention_names, "conv": _conv_names, "linear_attention": _delta_net_names,
               "mamba2": _mamba2_names}


def mixer_names(spec: ModelSpec, layer: int) -> list[str]:
    """The leaf names of layer ``layer``'s mixer weights; DecodertError for a kind decodert cannot run yet."""
    kind = spec.layer_kind(layer)
    if kind not in MIXER_NAMES:
        raise DecodertError(f"layer {layer} is a '{kind}' layer, which decodert cannot run yet "
                            f"(it runs {', '.join(MIXER_NAMES)})")
    return MIXER_NAMES[kind](spec)


def canonical_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical weight (used to validate checkpoints)."""
    leaf = name.rsplit(".", 1)[-1]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else 0
    h, d = spec.hidden_size, spec.head_dim_of(layer)
    inter, pl = spec.mlp_size(layer), spec.per_layer_input_size
    e, ie = spec.num_experts, spec.expert_intermediate_size
    if ".experts." in name:
        return {"gate_up": (e, 2 * ie, h), "down": (e, h, ie), "gate_up_bias": (e, 2 * ie), "down_bias": (e, h)}[leaf]
    shapes = {
        "router": (e, h),
        "router_bias": (e,),
        "shared_gate": (1, h),
        "o_bias": (h,),
        "sinks": (spec.num_heads,),
        "embed": (spec.vocab_size, h),
        "lm_head": (spec.vocab_size, h),
        "final_norm": (h,),
        "input_norm": (h,),
        "post_norm": (h,),
        "attn_out_norm": (h,),
        "mlp_out_norm": (h,),
        "qkv": (spec.layer_qkv_size(layer), h),
        "qkv_bias": (spec.layer_qkv_size(layer),),
        "q_norm": (d,),
        "k_norm": (d,),
        "o": (h, spec.num_heads * d),
        "gate_up": (2 * inter, h),
        "up": (inter, h),
        "down": (h, inter),
        "q": (spec.num_heads * d, h),
        "embed_per_layer": (spec.per_layer_vocab, spec.num_layers * pl),
        "per_layer_model_proj": (spec.num_layers * pl, h),
        "per_layer_proj_norm": (pl,),
        "ple_gate": (pl, h),
        "ple_proj": (h, pl),
        "ple_norm": (h,),
        "layer_scalar": (1,),
        "conv_in": (3 * h, h),
        "conv_in_bias": (3 * h,),
        "conv": (h, 1, spec.conv_kernel),
        "conv_bias": (h,),
        "conv_out": (h, h),
        "conv_out_bias": (h,),
        "linear_in": (sum(spec.fused_rows("linear_in") or ()), h),
        "linear_conv": (spec.linear_conv_channels, 1, spec.conv_kernel),
        "linear_a_log": (spec.linear_value_heads,),
        "linear_dt_bias": (spec.linear_value_heads,),
        "linear_norm": (spec.linear_value_dim,),
        "linear_out": (h, spec.linear_value_heads * spec.linear_value_dim),
        "mamba_in": (spec.ssm_inner + spec.ssm_conv_channels + spec.ssm_heads, h),
        "mamba_conv": (spec.ssm_conv_channels, 1, spec.conv_kernel),
        "mamba_conv_bias": (spec.ssm_conv_channels,),
        "mamba_a_log": (spec.ssm_heads,),
        "mamba_dt_bias": (spec.ssm_heads,),
        "mamba_d": (spec.ssm_heads,),
        "mamba_norm": (spec.ssm_inner,),
        "mamba_out": (h, spec.ssm_inner),
    }
    return shapes[leaf]
