"""The ``ort`` target: ONNX Runtime contrib ops, the fast CPU (and CUDA EP) path.

- RMSNorm          -> RMSNormalization-23 / com.microsoft.SkipSimplifiedLayerNormalization (fused add)
- int4/int8 linear -> com.microsoft.MatMulNBits (block-wise weights, accuracy_level as exported)
- float linear     -> com.microsoft.FusedMatMul (transB): activations stay [B, S, hidden], so no
                      layer needs a Reshape
- MoE MLP          -> com.microsoft.MoE / QMoE (router softmax + top-k + SwiGLU experts in one node)
- tied embedding   -> com.microsoft.GatherBlockQuantized on the quantized head (no float table kept)
- causal conv      -> com.microsoft.CausalConvWithState (LFM2's conv layers; the state update per row in standard ops)
- vision encoder   -> com.microsoft.MultiHeadAttention (vision.onnx, fp32; flash attention on the CPU) and
                      com.microsoft.FastGelu (SigLIP's gelu_tanh)
- CachedAttention  -> com.microsoft.GroupQueryAttention on packed qkv, rotary inside, past and
                      present sharing one buffer (seqlens_k = past + S - 1 per row, so right
                      padding keeps every valid row's positions exact).
                      A prefill whose image tokens attend both ways (Gemma 3) adds an If after it
                      (export/lowering/image_attention.py).
                      The verify graph attends with standard ops instead (export/lowering/verify_attention.py):
                      GQA refuses several tokens over a non-empty cache in more than one row, and
                      speculative decoding verifies every row of a batch in one pass
                      (manifest: graphs.verify.batched_past).
GQA's CPU kernel needs head_dim % 16 == 0 (other models keep the reference attention body, still
in place: ORT writes ScatterND's output into the bound past buffer) and rotates whole heads only:
with partial rotary (Phi-3, Qwen3.5) q and k are rotated before it and GQA runs with do_rotary=0;
so with M-RoPE (Qwen-VL): com.microsoft.MRotaryEmbedding over the 3-D positions (plugins/ops/mrope.py).
- GatedDeltaNet    -> com.microsoft.GatedDeltaNet (gates fused; q/k l2norm in standard ops; its V-major float32 state
                      is the cache buffer itself: initial_state and final_state may alias); a padded
                      token's a and b become -1e4 so its decay is exp(0) and its beta 0: the state
                      passes it unchanged
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.export.lowering import image_attention, verify_attention
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.plugins.ops import cached_attention as ca
from decodert.plugins.ops import causal_conv as cc
from decodert.plugins.ops.gated_delta_net import l2norm_body, valid_tokens
from decodert.plugins.ops import mamba2_ssm as m2
from decodert.plugins.ops import kv_dtypes
from decodert.plugins.ops import mrope
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.export.quantize.quant import quantized_embedding
from decodert.export.quantize.weight_layouts import NBITS
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.models.canonical import canonical_shape
from decodert.models.layers import GatedDeltaNetSpec, Mamba2Spec, MoESpec


@dataclass(frozen=True)
class GqaContext:
    seqlens_k: str  # [B] int32: past + S - 1
    total_len: str  # [] int32: max(past) + S
    cos_cache: str
    sin_cache: str
    window: int  # local_window_size (0 = full attention)
    cos: str | None = None  # partial rotary: RoPE applied before GQA (do_rotary=0), tables at the positions
    sin: str | None = None  # [B,S,1,R/2]
    mrope: str | None = None  # M-RoPE: positions [3,B,S]; q, k rotated by MRotaryEmbedding before GQA
    # bidirectional images (Gemma 3, prefill): export/lowering/image_attention.py reads these
    ahead: str | None = None  # [B,S] int64
    any_ahead: str = ""  # [] bool
    positions: str = ""  # [B,S] int64
    past_lengths: str = ""
    input_ids: str = ""


class OrtLowering(Lowering):
    target = "ort"
    quant_layout = NBITS
    opsets = {"": 23, "com.microsoft": 1}
    ir_version = 11
    flat_tokens = False  # MatMulNBits, FusedMatMul, the norms and GQA all take [B, S, hidden]

    standard_attention = False  # the verify graph's lowering (for_graph): export/lowering/verify_attention.py

    @property
    def use_gqa(self) -> bool:
        return not self.standard_attention and all(
            self.spec.head_dim_of(i) % 16 == 0 for i in range(self.spec.num_layers))  # head_dim_of: the model's
        # head_dim for a layer of another kind

    @property
    def batched_past(self) -> bool:
        return not self.use_gqa  # GQA: batch 1 when several tokens meet a non-empty cache

    def for_graph(self, kind: str) -> "OrtLowering":
        if kind != "verify" or not self.use_gqa:  # the reference attention takes any rows already
            return self
        low = copy.copy(self)
        low.standard_attention = True
        return low

    def context(self, g: GraphBuilder, inp: GraphInputs, window: int = 0) -> Any:
        if self.standard_attention:
            return verify_attention.context(g, inp, self.attn.num_kv_heads, self.max_seq, window, self.mrope(g, inp))
        if not self.use_gqa:
            return super().context(g, inp, window)
        with g.scope("attn_context"):
            seq = g.op("Gather", g.op("Shape", inp.input_ids), g.const(np.int64(1)), axis=0)
            last = g.op("Sub", g.op("Add", inp.past_lengths, seq), g.const(np.int64(1)))
            total = g.op("Add", g.op("ReduceMax", inp.past_lengths, keepdims=0), seq)
            cos = sin = pos3 = None
            if self.spec.mrope is not None:  # M-RoPE: 3-D positions, q and k rotated before GQA (plugins/ops/mrope.py)
                pos3 = mrope.positions3(g, inp.past_lengths, inp.input_ids)
            elif self.rotary_dim != self.head_dim:  # GQA rotates whole heads only: rotate before it
                pos = g.op("Add", g.op("Unsqueeze", inp.past_lengths, g.const([1])),
                           g.op("Unsqueeze", g.op("Range", g.const(np.int64(0)), seq, g.const(np.int64(1))), g.const([0])))
                cos, sin = (g.op("Unsqueeze", g.op("Gather", t, pos, axis=0), g.const([2]))
                            for t in (inp.cos_cache, inp.sin_cache))
            widen: dict[str, Any] = {}
            if inp.ahead is not None:  # a prefill whose image tokens see each other: the If in attention()
                widen = dict(ahead=inp.ahead, any_ahead=image_attention.any_ahead(g, inp.ahead),
                             positions=image_attention.positions(g, inp.past_lengths, inp.input_ids),
                             past_lengths=inp.past_lengths, input_ids=inp.input_ids)
            return GqaContext(g.op("Cast", last, to=6), g.op("Cast", total, to=6), inp.cos_cache, inp.sin_cache, window,
                              cos, sin, pos3, **widen)

    def embed(self, g: GraphBuilder, ids: str) -> str:
        if not quantized_embedding(self.spec, self.quant, self.quant_layout):
            return g.op("Gather", "embed", ids, axis=0)  # [B,S,hidden]
        q = self.quantized["lm_head"]  # tied and quantized: gather dequantized rows of the head
        zp = () if q.symmetric else ("lm_head.gather_zero_points",)
        rows = g.op("GatherBlockQuantized", "lm_head.q", ids, "lm_head.gather_scales", *zp, domain="com.microsoft",
                    bits=q.bits, block_size=q.block_size, quantize_axis=2, gather_axis=0)  # [B,S,blocks,block]
        hidden = self.spec.hidden_size
        x = g.op("Reshape", rows, g.const([0, 0, -(-hidden // q.block_size) * q.block_size]))
        return x if hidden % q.block_size == 0 else g.op("Slice", x, g.const([0]), g.const([hidden]), g.const([2]))

    def linear(self, g: GraphBuilder, x: str, weight: str, bias: str | None = None) -> str:
        """x [..., in] @ weight[out, in]^T (+ bias): FusedMatMul reads the weight transposed, in N-D."""
        if weight in self.quantized:
            return self.quantized_linear(g, x, weight, bias)
        y = g.op("FusedMatMul", x, weight, domain="com.microsoft", transB=1)
        return g.op("Add", y, bias) if bias else y

    def rms_norm(self, g: GraphBuilder, x: str, weight: str) -> str:
        return g.op("RMSNormalization", x, weight, axis=-1, epsilon=self.spec.rms_norm_eps, stash_type=1)

    def add_rms_norm(self, g: GraphBuilder, x: str, residual: str, weight: str) -> tuple[str, str]:
        y, _, _, s = g.op("SkipSimplifiedLayerNormalization", x, residual, weight, domain="com.microsoft",
                          epsilon=self.spec.rms_norm_eps, outputs=4)
        return y, s

    def quantized_linear(self, g: GraphBuilder, x: str, weight: str, bias: str | None) -> str:
        assert self.quant is not None  # accuracy_level is the export's; bits, block and zero points the weight's
        wq = self.quantized[weight]
        n, k = canonical_shape(self.spec, weight)
        zp = "" if wq.symmetric else f"{weight}.zero_points"
        g_idx = f"{weight}.g_idx" if wq.act_order else ""  # GPTQ act-order: each input's group
        y = g.op("MatMulNBits", x, f"{weight}.q", f"{weight}.scales", zp, g_idx, bias or "", domain="com.microsoft",
                 K=k, N=n, bits=wq.bits, block_size=wq.block_size, accuracy_level=self.quant.accuracy_level)
        if not wq.block_min:
            return y
        # GGUF Q4_1: W[n, k] = d*q + m[n, k // block], so x @ W^T adds (block sums of x) @ mins [blocks, N].
        # The block sums are x @ a 0/1 block indicator [K, blocks]: any rank of x, one constant per K.
        indicator = np.repeat(np.eye(k // wq.block_size), wq.block_size, axis=0)
        sums = g.op("MatMul", x, g.const(indicator, dtype=NUMPY_DTYPES[self.dtype]))
        return g.op("Add", y, g.op("MatMul", sums, f"{weight}.mins"))

    def causal_conv(self, g: GraphBuilder, x: str, weight: str, bias: str | None, state: tuple[str, str],
                    seq_lengths: str, kernel: int, channels: int | None = None, activation: str = "none",
                    window: str | None = None) -> str:
        """com.microsoft.CausalConvWithState (activation fused) over Concat(past, x), its first K-1 outputs dropped.

        The op's own past/present state is not used: its present holds the last K-1 positions of the
        padded call, and a right-padded row's state must end at its last valid token; and its past
        must have no reader besides the one node that precedes the write of present (the same
        buffer). So past is read by the Concat only, and present is taken per row as in the portable body."""
        past, present = state
        k = kernel
        cat = cc.full_window(g, x, past)  # [B, C, K-1+S]
        if window:
            g.op("Identity", cat, outputs=[window])
        y, _ = g.op("CausalConvWithState", cat, weight, bias or "", domain="com.microsoft", outputs=2,
                    activation=activation)
        cc.next_state(g, cat, seq_lengths, k, present)
        return g.op("Slice", y, g.const([k - 1]), g.const([np.iinfo(np.int64).max]), g.const([2]))  # [B, C, S]

    def moe(self, g: GraphBuilder, x: str, prefix: str, s: MoESpec, one_token_rows: bool) -> str:
        """com.microsoft.MoE (float experts) or QMoE (block-quantized): softmax over the router logits,
        top-k, renormalised when the spec says so, SwiGLU experts with gate/up interleaved (the only
        fused layout ORT's CPU kernel takes, and the canonical one); x [B, S, hidden] as is."""
        router_bias = prefix + "router_bias" if s.router_bias else None
        logits = g.op("Reshape", self.linear(g, x, prefix + "router", router_bias), g.const([-1, s.num_experts]))  # [T, E]
        gate_up, down = prefix + "experts.gate_up", prefix + "experts.down"
        b1, b2 = (gate_up + "_bias", down + "_bias") if s.expert_bias else ("", "")
        common: dict[str, Any] = dict(domain="com.microsoft", k=s.experts_per_token, activation_type="swiglu", swiglu_fusion=1,
                      normalize_routing_weights=int(s.renormalize), swiglu_limit=s.swiglu_limit,
                      activation_alpha=s.swiglu_alpha if s.swiglu_alpha != 1.0 else None,  # None: ORT's default
                      activation_beta=s.swiglu_beta or None)
        if gate_up not in self.quantized:
            return g.op("MoE", x, logits, gate_up, b1, down, b2, **common)
        assert self.quant is not None
        wq = self.quantized[gate_up]
        zp = ("", "") if wq.symmetric else (f"{gate_up}.zero_points", f"{down}.zero_points")
        return g.op("QMoE", x, logits, f"{gate_up}.q", f"{gate_up}.scales", b1, f"{down}.q", f"{down}.scales", b2,
                    "", "", "", *zp, **common, expert_weight_bits=wq.bits, block_size=wq.block_size,
                    weights_prepacked=0, accuracy_level=self.quant.accuracy_level)

    def attention(self, g: GraphBuilder, ctx: Any, qkv: str, cache: tuple[str, str, str, str],
                  sinks: str | None = None) -> str:
        if isinstance(ctx, verify_attention.VerifyContext):
            return verify_attention.attention(g, self, ctx, qkv, cache, sinks)
        if not isinstance(ctx, GqaContext):
            return super().attention(g, ctx, qkv, cache, sinks)
        s, m = self.attn, self.spec.mrope
        past_key, past_value, present_key, present_value = cache
        quant: dict[str, Any] = {}
        extra = ["", "", sinks or ""]  # position_ids, attention_bias, head_sink (gpt-oss's attention sinks)
        if self.kv.quantized:  # the cache holds int8 / packed int4 codes, one scale per (head, channel)
            extra += [kv_dtypes.scale_names(past_key), kv_dtypes.scale_names(past_value)]  # k_scale, v_scale
            quant = dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=self.kv.bits)
        qkv_in, rope = [qkv, "", ""], [ctx.cos_cache, ctx.sin_cache]
        if ctx.cos is not None:  # partial rotary: q and k rotated here, GQA without rotary
            d, h, hkv = self.head_dim, s.num_heads, s.num_kv_heads
            q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
            tables = ca.AttnContext("", "", ctx.cos, ctx.sin or "")  # rope_body reads cos and sin only
            q, k = (g.op("Reshape", ca.rope_body(g, g.op("Reshape", x, g.const([0, 0, n, d])), tables, d, self.rotary_dim),
                         g.const([0, 0, n * d])) for x, n in ((q, h), (k, hkv)))
            qkv_in, rope = [q, k, v], ["", ""]
        elif ctx.mrope is not None:
            d, h, hkv = self.head_dim, s.num_heads, s.num_kv_heads
            q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
            q, k = (g.op("MRotaryEmbedding", x, ctx.mrope, ctx.cos_cache, ctx.sin_cache, domain="com.microsoft",
                         num_heads=n, mrope_section=list(m.section), mrope_layout=int(m.interleaved),
                         rotary_embedding_dim=self.rotary_dim if self.rotary_dim != d else None)
                    for x, n in ((q, h), (k, hkv)))
            qkv_in, rope = [q, k, v], ["", ""]
        y, _, _ = g.op(
            "GroupQueryAttention", *qkv_in, past_key, past_value, ctx.seqlens_k, ctx.total_len,
            *_trim([*rope, *extra]), domain="com.microsoft", outputs=[None, present_key, present_value],
            num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, do_rotary=int(ctx.cos is None and ctx.mrope is None),
            rotary_interleaved=0,
            scale=self.scale, local_window_size=ctx.window or None, softcap=self.softcap or None, **quant,
        )
        if ctx.ahead is not None:  # bidirectional image tokens: GQA is causal only
            q = qkv_in[0] if ctx.cos is not None else g.op("Slice", qkv, g.const([0]),
                                                          g.const([s.num_heads * self.head_dim]), g.const([2]))
            return image_attention.widen(g, self, ctx, q, ctx.cos is not None, y, cache, sinks)
        return y

    def gated_delta_net(self, g: GraphBuilder, qkvab: tuple[str, str, str, str, str], a_log: str, dt_bias: str,
                        state: tuple[str, str], seq_lengths: str, s: GatedDeltaNetSpec, single: bool = False) -> str:
        q, k, v, a, b = qkvab
        past, present = state
        if not single:  # padded tokens: softplus(-1e4 + dt_bias) = 0 -> decay 1; sigmoid(-1e4) = 0 -> beta 0
            valid = valid_tokens(g, a, seq_lengths)
            low = g.const(np.array(-1e4, NUMPY_DTYPES[self.dtype]))
            a, b = g.op("Where", valid, a, low), g.op("Where", valid, b, low)
        heads = lambda x, n, d: g.op("Reshape", x, g.const([0, 0, n, d]))  # noqa: E731
        # l2norm here, as transformers does (x * rsqrt(sum x^2 + 1e-6)): the kernel's qk_l2_norm uses another
        # epsilon, which moves small q/k heads by 1e-3
        t = NUMPY_DTYPES[self.dtype]
        qn = l2norm_body(g, heads(q, s.key_heads, s.key_dim), t)
        kn = l2norm_body(g, heads(k, s.key_heads, s.key_dim), t)
        y, _ = g.op("GatedDeltaNet", qn, kn, heads(v, s.value_heads, s.value_dim),
                    "", a, b, past, self.float32(g, a_log), self.float32(g, dt_bias), domain="com.microsoft",
                    outputs=[None, present], gate_activation="softplus", beta_activation="sigmoid", qk_l2_norm=0,
                    scale=s.key_dim ** -0.5)
        return g.op("Reshape", y, g.const([0, 0, s.value_heads * s.value_dim]))

    def mamba2_ssm(self, g: GraphBuilder, xdtbc: tuple[str, str, str, str], prefix: str, state: tuple[str, str],
                   seq_lengths: str, s: Mamba2Spec, single: bool = False) -> str:
        """com.microsoft.LinearAttention, update_rule "gated" (plugins/ops/mamba2_ssm.py): query c, key b (each group's
        rows repeated for its heads), value dt x, log decay -exp(a_log) dt, scale 1; its state [B, H, N, Dh] is the
        bound buffer. dt and the rest in float32; the D skip added after."""
        x, dt, b, c = (self.float32(g, v) for v in xdtbc)
        a_log, dt_bias, d = (self.float32(g, prefix + n) for n in ("mamba_a_log", "mamba_dt_bias", "mamba_d"))
        h, n, dh = s.heads, s.state, s.head_dim
        x4, value, log_decay = m2.gates(g, x, dt, a_log, dt_bias, "" if single else seq_lengths, heads=h, head_dim=dh)
        key, query = (g.op("Reshape", m2.per_head(g, v, heads=h, groups=s.groups, state=n), g.const([0, 0, h * n]))
                      for v in (b, c))
        y, _ = g.op("LinearAttention", query, key, g.op("Reshape", value, g.const([0, 0, h * dh])), state[0], log_decay,
                    domain="com.microsoft", outputs=[None, state[1]], update_rule="gated", q_num_heads=h,
                    kv_num_heads=h, scale=1.0)
        skip = g.op("Reshape", g.op("Mul", x4, g.op("Unsqueeze", d, g.const([1]))), g.const([0, 0, h * dh]))
        y = g.op("Add", y, skip)
        return y if self.dtype == "fp32" else g.op("Cast", y, to=DTYPES[self.dtype])

    @classmethod
    def encoder_attention(cls, g: GraphBuilder, q: str, k: str, v: str, heads: int, head_dim: int, np_dtype: type,
                          valid: str | None = None, bias: str | None = None) -> str:
        """com.microsoft.MultiHeadAttention: no [B, H, S, S] scores in memory (its CPU kernel runs flash
        attention when no key is masked; with ``valid``, the key padding mask, it attends row by row). Its CPU
        kernel is float32 only: other dtypes keep the standard-op body."""
        if np_dtype != np.float32 or bias is not None:
            return super().encoder_attention(g, q, k, v, heads, head_dim, np_dtype, valid, bias)
        g.opsets.setdefault("com.microsoft", 1)
        mask = "" if valid is None else g.op("Cast", valid, to=DTYPES["int32"])
        return g.op("MultiHeadAttention", q, k, v, "", mask, domain="com.microsoft", num_heads=heads,
                    scale=head_dim ** -0.5)

    seq2seq_opsets = {"": 17, "com.microsoft": 1}

    @classmethod
    def seq2seq_context(cls, g: GraphBuilder, past_lengths: str, input_ids: str, max_seq: int) -> Any:
        """GroupQueryAttention's (seqlens_k [B] int32 = tokens after the step - 1, total_sequence_length [] int32)."""
        seq = g.op("Gather", g.op("Shape", input_ids), g.const(np.array(1, np.int64)), axis=0)  # S (scalar)
        total = g.op("Add", past_lengths, seq)  # [B] tokens after this step
        seqlens_k = g.op("Cast", g.op("Sub", total, g.const(np.array(1, np.int64))), to=DTYPES["int32"])
        return seqlens_k, g.op("Cast", g.op("ReduceMax", total, keepdims=0), to=DTYPES["int32"])

    @classmethod
    def seq2seq_self_attention(cls, g: GraphBuilder, ctx: Any, q: str, k: str, v: str, cache: tuple[str, str, str, str],
                               past_lengths: str, heads: int, head_dim: int, max_seq: int) -> str:
        """com.microsoft.GroupQueryAttention with one shared past/present buffer (written in place), no rotary."""
        past_key, past_value, present_key, present_value = cache
        return g.op("GroupQueryAttention", q, k, v, past_key, past_value, *ctx, domain="com.microsoft",
                    outputs=[None, present_key, present_value], num_heads=heads, kv_num_heads=heads, do_rotary=0,
                    scale=head_dim ** -0.5)[0]

    @classmethod
    def seq2seq_cross_attention(cls, g: GraphBuilder, q: str, key: str, value: str, heads: int, head_dim: int) -> str:
        """com.microsoft.MultiHeadAttention takes K/V already in [B, H, T, D]: nothing moved per step."""
        return g.op("MultiHeadAttention", q, key, value, domain="com.microsoft", num_heads=heads,
                    scale=head_dim ** -0.5)

    @classmethod
    def encoder_gelu_tanh(cls, g: GraphBuilder, x: str, np_dtype: type) -> str:
        """com.microsoft.FastGelu: one pass instead of eight elementwise ones (its CPU kernel: float32)."""
        if np_dtype != np.float32:
            return super().encoder_gelu_tanh(g, x, np_dtype)
        g.opsets.setdefault("com.microsoft", 1)
        return g.op("FastGelu", x, domain="com.microsoft")

    def cacheless_attention(self) -> bool:
        """GroupQueryAttention without past inputs is a prompt over its own keys (a float cache of the model's dtype:
        a quantized one would need scales the call has no use for)."""
        return self.use_gqa and not self.standard_attention and self.kv.name == self.dtype

    def kv_problem(self) -> str | None:
        """GroupQueryAttention's CPU kernel (ORT 1.32) stores int8 and int4 codes and float caches of the
        model's dtype or fp16; it has no float8 cache kernel, and no bf16 cache under float activations."""
        if not self.use_gqa:
            return super().kv_problem()
        if self.kv.name in ("int8", "int4", "fp16", self.dtype):
            return None
        if self.kv.name == "fp8":
            return ("ONNX Runtime's CPU GroupQueryAttention has no float8 KV cache kernel "
                    "(use --kv-dtype int8, or --target portable for Q/DQ in standard ops)")
        return f"ONNX Runtime's CPU GroupQueryAttention has no {self.kv.name} cache under {self.dtype} activations"


def _trim(inputs: list[str]) -> list[str]:
    """Optional inputs without the trailing omitted ones ("")."""
    while inputs and not inputs[-1]:
        inputs = inputs[:-1]
    return inputs
