"""The frozen model description every other part of decodert reads.

A family file (``models/families/llama.py`` ...) turns a Hugging Face ``config.json`` dict or GGUF
metadata into a :class:`ModelSpec` and declares where each *canonical* weight comes from.
Graph code only ever sees canonical names (``canonical_names`` in models/canonical.py), never checkpoint keys.
Norm weights are canonical as the factor that multiplies: a checkpoint that stores ``w`` for a
``(1 + w)`` norm (Gemma) is shifted when it is read, as llama.cpp's converter does for GGUF.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from decodert.models.rope import RopeSpec  # defined in models/rope.py; imported from here too


@dataclass(frozen=True)
class ModelSpec:
    """Everything the graph recipe needs about a decoder-only transformer."""

    family: str  # models/families/<family>.py
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec = field(default_factory=RopeSpec)
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # window of the sliding layers (Mistral: every layer; None = none)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # -- what a family changes beyond Llama; the defaults are Llama's -------------------------------
    activation: str = "silu"  # MLP gate: "silu" | "gelu_tanh" (Gemma's gelu_pytorch_tanh) | "relu2" (Nemotron-H: relu(x)^2)
    gated_mlp: bool = True  # down(act(gate) * up); False: down(act(up)) (Nemotron-H), weights layers.{i}.up
    sandwich_norm: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before each residual add
    embed_scale: float | None = None  # Gemma: embeddings x sqrt(hidden), the factor rounded to the graph dtype
    layer_types: tuple[str, ...] = ()  # per layer "sliding" | "full"; () = all sliding iff sliding_window
    local_rope: RopeSpec | None = None  # RoPE of the sliding layers when it differs (Gemma 3: local base)
    attn_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap), before the causal mask
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    residual_scale: float = 1.0  # Granite: each mixer and MLP output x this before its residual add
    logits_scaling: float = 1.0  # Granite: logits / this
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a gate per head; attention output *= sigmoid(gate)
    # -- hybrid models: what mixes tokens in each layer, and the state it keeps (docs/ARCHITECTURE.md, "Cache state")
    layer_kinds: tuple[str, ...] = ()  # per layer, one of LAYER_KINDS; () = every layer "attention"
    conv_kernel: int = 0  # K of the layers' causal depthwise conv (LFM2 conv_L_cache; DeltaNet/Mamba2 conv); state K-1
    conv_bias: bool = False  # LFM2: biases on the conv layer's in/out projections and the conv
    linear_key_heads: int = 0  # "linear_attention" (Gated DeltaNet): key heads, value heads, their dims
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    ssm_heads: int = 0  # "mamba2": heads, head dim, state size N, groups of B/C (and of the gated norm)
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    # -- mixture of experts (num_experts = 0: every MLP is dense) -----------------------------------
    num_experts: int = 0  # experts per MoE layer
    experts_per_token: int = 0  # top-k the router picks
    expert_intermediate_size: int = 0  # each expert's SwiGLU width
    router_renormalize: bool = True  # the top-k softmax weights are rescaled to sum to 1 (Qwen3-MoE norm_topk_prob)
    mlp_types: tuple[str, ...] = ()  # per layer "dense" | "moe" | "none"; () = every layer "moe" iff num_experts
    shared_mlp: bool = False  # Granite 4.0-H: a MoE layer also runs the dense MLP (intermediate_size), outputs added
    shared_mlp_gate: bool = False  # Qwen3.5-MoE: that MLP's output x sigmoid(h @ shared_gate^T), one gate per token
    o_bias: bool = False  # gpt-oss: a bias on the attention output projection
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax (weights layers.{i}.sinks)
    router_bias: bool = False  # gpt-oss: router logits = h @ router^T + bias
    expert_bias: bool = False  # gpt-oss: biases on every expert's gate_up and down
    swiglu_limit: float | None = None  # gpt-oss: gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.0  # experts: gate * sigmoid(alpha * gate) * (up + beta); silu(gate) * up by default
    swiglu_beta: float = 0.0
    nope_layers: tuple[int, ...] = ()  # layers whose q and k get no RoPE (SmolLM3: every 4th); they read the
    # identity table "rope_none" (angle 0), so every lowering's attention serves them unchanged
    # -- Gemma 4 (E2B/E4B): per-layer inputs, K/V shared across layers, per-layer MLP widths ---------
    per_layer_input_size: int = 0  # P: each layer adds gelu(x @ ple_gate^T) * per_layer_input[i] @ ple_proj^T
    per_layer_vocab: int = 0  # rows of the per-layer embedding table embed_per_layer [Vp, L*P]
    layer_scalar: bool = False  # the residual stream is multiplied by layers.{i}.layer_scalar [1] after each layer
    v_norm: bool = False  # RMSNorm without weight over head_dim on v (with qk_norm)
    kv_sources: tuple[int, ...] = ()  # per layer, the layer whose K/V cache it reads (itself: its own); () = own
    mlp_sizes: tuple[int, ...] = ()  # per layer, the dense MLP's width; () = intermediate_size everywhere
    layer_head_dims: tuple[int, ...] = ()  # per layer head_dim (Gemma 4's full layers: global_head_dim); () = head_dim
    image_token_id: int | None = None  # vision-language: prefill takes image embeddings at this token's rows
    # M-RoPE (Qwen2-VL / 2.5-VL / 3-VL): each rotary pair j turns by the position on axis t, h or w (plugins/ops/mrope.py);
    # the graphs take rope_offsets [3, B, S] (position - cache index per axis). () = ordinary 1-D RoPE
    mrope_section: tuple[int, ...] = ()  # pairs per axis (t, h, w), summing to rotary_dim / 2
    mrope_interleaved: bool = False  # Qwen3-VL: pairs t, h, w, t, h, w, ... instead of three blocks
    deepstack_layers: int = 0  # Qwen3-VL: after each of the first n layers the image rows gain deepstack_embeds[i]
    bidirectional_images: bool = False  # Gemma 3: in prefill, the tokens of one image attend to each other
    # both ways (transformers' token_type_ids mask); prefill then takes image_ahead (export/lowering/graph.py)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")
        if self.layer_kinds:
            unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
            if unknown:
                raise ValueError(f"layer kind '{unknown[0]}' is not one of {', '.join(LAYER_KINDS)}")
            if len(self.layer_kinds) != self.num_layers:
                raise ValueError(f"layer_kinds must name {self.num_layers} layers")
            if set(self.layer_kinds) - {"attention", "none"} and self.conv_kernel < 2:
                raise ValueError("conv, linear_attention and mamba2 layers need a conv_kernel >= 2")
            if "mamba2" in self.layer_kinds and (min(self.ssm_heads, self.ssm_head_dim, self.ssm_state, self.ssm_groups) < 1
                                                 or self.ssm_heads % self.ssm_groups):
                raise ValueError(f"mamba2 layers need positive ssm sizes and heads ({self.ssm_heads}) a multiple of "
                                 f"groups ({self.ssm_groups})")
        if self.local_rope is not None and self.local_rope.rotary_dim != self.rope.rotary_dim:
            raise ValueError("the local and global RoPE must rotate the same dims")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.expert_intermediate_size < 1:
                raise ValueError(f"router top-k {self.experts_per_token} must be 1..{self.num_experts} experts and "
                                 f"the expert width {self.expert_intermediate_size} positive")
            if self.activation != "silu":  # the MoE/QMoE ops and plugins/ops/moe.py compute SwiGLU experts
                raise ValueError(f"experts with activation '{self.activation}' are not supported (SwiGLU only)")
        if self.shared_mlp_gate and not (self.num_experts and self.shared_mlp):
            raise ValueError("shared_mlp_gate gates the shared MLP of MoE layers: it needs experts and shared_mlp")
        if self.mlp_types and (len(self.mlp_types) != self.num_layers or set(self.mlp_types) - set(MLP_TYPES)
                               or ("moe" in self.mlp_types and not self.num_experts)):
            raise ValueError(f"mlp_types must name {self.num_layers} layers, each one of {', '.join(MLP_TYPES)} "
                             "('moe' only with experts)")
        # over the declared lists, never range(num_layers): a config's layer count is untrusted until checked
        if any(k == "none" and m == "none" for k, m in zip(self.layer_kinds, self.mlp_types)):
            raise ValueError("a layer needs a mixer or an MLP (layer kind 'none' with mlp type 'none')")
        if self.mrope_section and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0
                                   or sum(self.mrope_section) != (self.rope.rotary_dim or self.head_dim) // 2):
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be 3 counts summing to half the rotary dim")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} must be layers 0..{self.num_layers - 1}")
        if self.kv_sources and (len(self.kv_sources) != self.num_layers or any(
                not 0 <= j <= i or self.kv_sources[j] != j or self.is_sliding(j) != self.is_sliding(i)
                or self.layer_kind(j) != "attention" for i, j in enumerate(self.kv_sources))
                or self.layer_kinds or list(self.kv_layers) != list(range(len(self.kv_layers)))):
            raise ValueError(f"kv_sources must name, for each of {self.num_layers} layers, itself or an earlier "
                             "attention layer of the same kind that keeps its own cache; the layers that share "
                             "come last (the manifest's K/V layers are 0..n-1), in a model of attention layers only")
        if self.layer_head_dims and (len(self.layer_head_dims) != self.num_layers or min(self.layer_head_dims) < 2):
            raise ValueError(f"layer_head_dims must give {self.num_layers} head dims")
        dims: dict[str, set[int]] = {}
        for i in range(len(self.layer_head_dims)):  # () for every model but those with per-layer head dims
            dims.setdefault(rope_table_of(self, i), set()).add(self.head_dim_of(i))
        if any(len(d) > 1 for d in dims.values()):
            raise ValueError("layers of one RoPE table must share a head_dim (give the sliding layers a local_rope)")
        if self.mlp_sizes and (len(self.mlp_sizes) != self.num_layers or min(self.mlp_sizes) < 1):
            raise ValueError(f"mlp_sizes must give {self.num_layers} positive widths")
        for name in ("sliding_window", "attn_softcap", "final_softcap", "attn_scale", "embed_scale", "residual_scale",
                     "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} {value!r} must be positive")

    def is_sliding(self, layer: int) -> bool:
        """Does layer ``layer`` attend over a sliding window (the rest see the whole prefix)?"""
        if self.layer_types:
            return self.layer_types[layer] == "sliding"
        return self.sliding_window is not None

    def layer_kind(self, layer: int) -> str:
        """What mixes tokens in layer ``layer``: one of LAYER_KINDS ("attention" unless declared)."""
        return self.layer_kinds[layer] if self.layer_kinds else "attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V (attention), in order: their caches are past_key.{i} / past_value.{i}."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) == "attention" and self.kv_source(i) == i)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V cache layer ``layer`` attends over: itself, or (Gemma 4's KV sharing) an earlier
        layer of the same kind; a sharing layer computes no K/V and has no cache of its own."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def head_dim_of(self, layer: int) -> int:
        """Layer ``layer``'s head_dim (its q, k, v heads and its cache's last dimension)."""
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    @property
    def head_dims(self) -> tuple[int, ...]:
        """The head_dim of each K/V layer (``kv_layers``), in order: their caches' last dimension."""
        return tuple(self.head_dim_of(i) for i in self.kv_layers)

    def mlp_size(self, layer: int) -> int:
        """The dense MLP width of layer ``layer`` (Gemma 4: double on the KV-sharing layers)."""
        return self.mlp_sizes[layer] if self.mlp_sizes else self.intermediate_size

    def has_mlp(self, layer: int) -> bool:
        """Does layer ``layer`` end with an MLP (post_norm + MLP)? Not where mlp_types says "none"."""
        return not self.mlp_types or self.mlp_types[layer] != "none"

    def has_mixer(self, layer: int) -> bool:
        """Does layer ``layer`` mix tokens (input_norm + mixer)? Not a "none" layer (an MLP alone)."""
        return self.layer_kind(layer) != "none"

    def is_moe(self, layer: int) -> bool:
        """Is layer ``layer``'s MLP a mixture of experts (router + experts) rather than one dense SwiGLU?"""
        if self.mlp_types:
            return self.mlp_types[layer] == "moe"
        return self.num_experts > 0

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> RopeSpec:
        if layer in self.nope_layers:
            return dataclasses.replace(NO_ROPE, rotary_dim=self.rope.rotary_dim)
        return self.local_rope if self.local_rope is not None and self.is_sliding(layer) else self.rope

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused qkv weight (layer 0's: ``layer_qkv_size``)."""
        return self.layer_qkv_size(0)

    def layer_qkv_size(self, layer: int) -> int:
        """Rows of layer ``layer``'s fused qkv weight: (H + 2 H_kv) * D, plus H * D gate rows with attn_output_gate."""
        return (self.num_heads * (2 if self.attn_output_gate else 1) + 2 * self.num_kv_heads) * self.head_dim_of(layer)

    def fused_rows(self, leaf: str, layer: int = 0) -> tuple[int, ...] | None:
        """The row count of each checkpoint part concatenated into a fused weight (None: equal parts)."""
        d = self.head_dim_of(layer)
        if leaf in ("qkv", "qkv_bias"):
            q = self.num_heads * d * (2 if self.attn_output_gate else 1)
            return (q, self.num_kv_heads * d, self.num_kv_heads * d)
        if leaf == "linear_in":
            hv = self.linear_value_heads
            return (self.linear_conv_channels, hv * self.linear_value_dim, hv, hv)
        return None

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a linear-attention layer's conv: q, k and v (2 Hk Dk + Hv Dv)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def ssm_inner(self) -> int:
        """A mamba2 layer's inner width H Dh (x, z, y)."""
        return self.ssm_heads * self.ssm_head_dim

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of a mamba2 layer's conv: x, B and C (H Dh + 2 G N)."""
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["layer_kinds"] = list(self.layer_kinds)
        d["mlp_types"] = list(self.mlp_types)
        d["nope_layers"] = list(self.nope_layers)
        d["mrope_section"] = list(self.mrope_section)
        d["mlp_sizes"] = list(self.mlp_sizes)
        d["layer_head_dims"] = list(self.layer_head_dims)
        d["kv_sources"] = list(self.kv_sources)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        """The inverse of to_dict; a dict written before a field existed gets that field's default."""
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        if d.get("local_rope") is not None:
            d["local_rope"] = RopeSpec(**d["local_rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["layer_kinds"] = tuple(d.get("layer_kinds", ()))
        d["mlp_types"] = tuple(d.get("mlp_types", ()))
        d["nope_layers"] = tuple(d.get("nope_layers", ()))
        d["mrope_section"] = tuple(d.get("mrope_section", ()))
        d["mlp_sizes"] = tuple(d.get("mlp_sizes", ()))
        d["layer_head_dims"] = tuple(d.get("layer_head_dims", ()))
        d["kv_sources"] = tuple(d.get("kv_sources", ()))
        return cls(**d)


NO_ROPE = RopeSpec(scaling="none")  # what a layer without RoPE reads: the identity rotation
ACTIVATIONS = ("silu", "gelu_tanh", "relu2")
LAYER_TYPES = ("sliding", "full")
# What mixes tokens in a layer. "attention": K/V [H_kv, S_max, D]; "conv": LFM2's gated short conv,
# a rolling conv state; "linear_attention": Gated DeltaNet (Qwen3.5), a conv state and a recurrent
# state; "mamba2": a conv state and an SSM state (Nemotron-H, Granite 4.0-H); "none": no mixer, the layer is
# its MLP alone (Nemotron-H's MLP blocks; mlp_types "none" is the converse, a mixer without an MLP).
LAYER_KINDS = ("attention", "conv", "linear_attention", "mamba2", "none")


@dataclass(frozen=True)
class StateSpec:
    """One per-slot state tensor a non-attention layer keeps (graph I/O ``past_{name}.{layer}`` /
    ``present_{name}.{layer}``, one buffer [batch, *shape] bound to both)."""

    layer: int
    name: str  # "conv" | "recurrent"
    shape: tuple[int, ...]  # per slot, without the batch dim
    dtype: str | None = None  # None: the model dtype; "fp32": a recurrent state, whatever the model dtype

    @property
    def io_name(self) -> str:
        return f"{self.name}.{self.layer}"


def _conv_states(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {"conv": (spec.hidden_size, spec.conv_kernel - 1)}  # [C, K-1]: the last K-1 inputs of the conv


def _delta_net_states(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {"conv": (spec.linear_conv_channels, spec.conv_kernel - 1),  # conv over q, k, v
            # V-major [H_v, Dv, Dk]: ONNX Runtime's GatedDeltaNet state, bound as is (plugins/ops/gated_delta_net.py)
            "recurrent": (spec.linear_value_heads, spec.linear_value_dim, spec.linear_key_dim)}


def _mamba2_states(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    channels = spec.ssm_conv_channels
    # [H, N, Dh]: ONNX Runtime's LinearAttention state (B, H, d_k, d_v) with k = B, v = dt x, bound as is
    return {"conv": (channels, spec.conv_kernel - 1),  # conv over x, B, C
            "recurrent": (spec.ssm_heads, spec.ssm_state, spec.ssm_head_dim)}


# kind -> the states one layer of that kind keeps (attention's K/V are the KV cache, not listed here)
STATE_SHAPES = {"attention": lambda spec: {}, "conv": _conv_states, "linear_attention": _delta_net_states,
                "mamba2": _mamba2_states, "none": lambda spec: {}}


def window_layers(spec: ModelSpec) -> tuple[int, ...]:
    """Conv layers whose verify pass outputs its conv window ``window_conv.{i}`` [B, C, K-1+S] (the pass's
    inputs after the state), so accepting j tokens takes the state after j from it instead of a replay;
    () unless every state of the model is a conv state (a recurrent state cannot be taken from its inputs)."""
    states = state_specs(spec)
    if not states or any(st.name != "conv" for st in states):
        return ()
    return tuple(st.layer for st in states)


def state_specs(spec: ModelSpec) -> tuple[StateSpec, ...]:
    """Every per-slot state of the model beyond K/V, by layer, then name (the graphs' I/O order)."""
    return tuple(StateSpec(i, name, shape, STATE_DTYPES.get(name)) for i in range(spec.num_layers)
                 for name, shape in STATE_SHAPES[spec.layer_kind(i)](spec).items())


# A recurrent state accumulates every step: it is kept in float32 in fp16/bf16 models too (ONNX Runtime's
# GatedDeltaNet takes no other type); a conv state holds inputs as they were, in the model dtype.
STATE_DTYPES = {"recurrent": "fp32"}


MLP_TYPES = ("dense", "moe", "none")


def rope_head_dim(spec: ModelSpec, table: str) -> int:
    """The head_dim of the layers that read RoPE table ``table`` (one per table: ModelSpec checks it)."""
    return next((spec.head_dim_of(i) for i in range(spec.num_layers) if rope_table_of(spec, i) == table), spec.head_dim)


def rope_tables(spec: ModelSpec) -> dict[str, RopeSpec]:
    """The RoPE tables a model's graphs read, by weight-name prefix: ``rope`` (+ ``rope_local``)."""
    tables = {"rope": spec.rope}
    if spec.local_rope is not None and any(spec.is_sliding(i) for i in range(spec.num_layers)):
        tables["rope_local"] = spec.local_rope
    if spec.nope_layers:
        tables["rope_none"] = dataclasses.replace(NO_ROPE, rotary_dim=spec.rope.rotary_dim)
    return tables


def rope_table_of(spec: ModelSpec, layer: int) -> str:
    """The rope_tables prefix layer ``layer`` reads."""
    if layer in spec.nope_layers:
        return "rope_none"
    return "rope_local" if spec.local_rope is not None and spec.is_sliding(layer) else "rope"
