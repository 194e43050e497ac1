"""Canonical weights: the names and shapes the graph recipe reads, for any ModelSpec.

Every family's checkpoint reader maps its keys onto these (models/families/<family>.py tables); the export writes
them to weights.bin in this order and checks each tensor's shape against ``canonical_shape``.
"""

from __future__ import annotations

from decodert.models.spec import ModelSpec


def canonical_names(spec: ModelSpec) -> list[str]:
    """Canonical weight names, in the order they are written to weights.bin.

    Layout is the checkpoint's [out_features, in_features] for every linear weight.

    - ``embed``                     [V, hidden]
    - ``layers.{i}.input_norm``     [hidden]                     the norm in front of the layer's mixer
    - the mixer's weights (its kind spec's ``leaves()``, models/layers/); an "attention" layer's:
      - ``layers.{i}.qkv``          [(H + 2 H_kv) * D, hidden]   rows: q heads, k heads, v heads
      - ``layers.{i}.qkv_bias``     [(H + 2 H_kv) * D]           (AttentionSpec.qkv_bias)
      - ``layers.{i}.q_norm``       [D]                          (AttentionSpec.qk_norm)
      - ``layers.{i}.k_norm``       [D]                          (AttentionSpec.qk_norm)
      - ``layers.{i}.o``            [hidden, H * D]
      - ``layers.{i}.o_bias``       [hidden]                     (AttentionSpec.o_bias)
      - ``layers.{i}.sinks``        [H]                          (AttentionSpec.sinks: each head's sink logit)
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
      a layer without a mixer has no input_norm and no mixer weights (it is its MLP alone)
      with AttentionSpec.output_gate, ``qkv`` rows are q heads, gate heads, k heads, v heads
    - ``layers.{i}.attn_out_norm``  [hidden]                     (sandwich_norm only: on the mixer's output)
    - ``layers.{i}.post_norm``      [hidden]                     the norm in front of the MLP
    - ``layers.{i}.gate_up``        [2 * I, hidden]              rows: gate, then up (``up`` [I, hidden] where the
                                                                 DenseMLPSpec is not gated); no post_norm nor MLP
                                                                 in a layer without an MLP
    - ``layers.{i}.down``           [hidden, I]
      or, in a MoE layer (a MoESpec; Ie = expert_size, E = num_experts):
    - ``layers.{i}.router``         [E, hidden]                  router logits = h @ router^T
    - ``layers.{i}.experts.gate_up`` [E, 2 * Ie, hidden]         rows interleaved: gate 0, up 0, gate 1, ...
    - ``layers.{i}.experts.down``   [E, hidden, Ie]
    - ``layers.{i}.router_bias`` [E], ``experts.gate_up_bias`` [E, 2 Ie] (interleaved), ``experts.down_bias``
      [E, hidden]                                                (MoESpec.router_bias / expert_bias)
    - ``layers.{i}.gate_up``, ``layers.{i}.down``               (MoESpec.shared: the dense MLP beside the experts)
    - ``layers.{i}.shared_gate`` [1, hidden]                       (MoESpec.shared_gate: sigmoid(h @ it^T) scales it)
    - ``layers.{i}.mlp_out_norm``   [hidden]                     (sandwich_norm only: on the MLP output)
    - ``final_norm``                [hidden]
    - ``lm_head``                   [V, hidden]                  (absent when tied)

    Gemma 4 (E2B/E4B): a layer that reads another layer's K/V (``spec.kv_source(i) != i``) has ``layers.{i}.q``
    [H * D, hidden] (and ``q_norm``) instead of ``qkv`` / ``k_norm``; ``layers.{i}.gate_up`` / ``down`` are
    ``spec.mlp_size(i)`` wide. Per-layer inputs (``per_layer_inputs``: P its size, L layers) add, after ``embed``,
    ``embed_per_layer`` [Vp, L * P], ``per_layer_model_proj`` [L * P, hidden], ``per_layer_proj_norm`` [P], and per
    layer, after the MLP's weights, ``layers.{i}.ple_gate`` [P, hidden], ``ple_proj`` [hidden, P], ``ple_norm``
    [hidden]; ``layers.{i}.layer_scalar`` [1] closes each layer with ``layer_scalar``.
    """
    names = ["embed"]
    if spec.per_layer_inputs is not None:
        names += ["embed_per_layer", "per_layer_model_proj", "per_layer_proj_norm"]
    for i in range(spec.num_layers):
        names += [f"layers.{i}.{leaf}" for leaf in _layer_leaves(spec, i)]
    names.append("final_norm")
    if not spec.tie_word_embeddings:
        names.append("lm_head")
    return names


def _layer_leaves(spec: ModelSpec, i: int) -> list[str]:
    """Layer ``i``'s weight names after ``layers.{i}.``, in canonical_names' order."""
    layer, leaves = spec.layers[i], []
    if layer.mixer is not None:
        leaves += ["input_norm", *layer.mixer.leaves()]
        leaves += ["attn_out_norm"] if spec.sandwich_norm else []
    if layer.mlp is not None:
        leaves += ["post_norm", *layer.mlp.leaves()]
        leaves += ["mlp_out_norm"] if spec.sandwich_norm else []
    if spec.per_layer_inputs is not None:
        leaves += ["ple_gate", "ple_proj", "ple_norm"]
    if spec.layer_scalar:
        leaves.append("layer_scalar")
    return leaves


def canonical_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The expected shape of a canonical weight (used to validate checkpoints)."""
    h = spec.hidden_size
    if not name.startswith("layers."):
        pl = spec.per_layer_inputs
        p, vp = (pl.size, pl.vocab) if pl is not None else (0, 0)
        return {"embed": (spec.vocab_size, h), "lm_head": (spec.vocab_size, h), "final_norm": (h,),
                "embed_per_layer": (vp, spec.num_layers * p), "per_layer_model_proj": (spec.num_layers * p, h),
                "per_layer_proj_norm": (p,)}[name]
    _, index, leaf = name.split(".", 2)
    layer = spec.layers[int(index)]
    if leaf in ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "ple_norm"):
        return (h,)
    if leaf in ("ple_gate", "ple_proj", "layer_scalar"):
        p = spec.per_layer_inputs.size if spec.per_layer_inputs is not None else 0
        return {"ple_gate": (p, h), "ple_proj": (h, p), "layer_scalar": (1,)}[leaf]
    for part in (layer.mixer, layer.mlp):
        if part is not None and leaf in part.leaves():
            return part.shapes(h)[leaf]
    raise KeyError(f"'{name}' is not a canonical weight of this {spec.family} model")


def fused_rows(spec: ModelSpec, name: str) -> tuple[int, ...] | None:
    """The row count of each checkpoint part concatenated into canonical weight ``name`` (None: equal parts)."""
    if not name.startswith("layers."):
        return None
    _, index, leaf = name.split(".", 2)
    mixer = spec.layers[int(index)].mixer
    return mixer.fused_rows(leaf) if mixer is not None else None
