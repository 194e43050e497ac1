"""The lowering interface: how each decodert op becomes ONNX nodes for one target.

The base class is the ``portable`` target: every op is its reference body of standard ONNX ops
(opset 21), so any conformant runtime runs it. ``lower_ort`` and ``lower_trt`` override the ops
their runtime has fast kernels or native layers for.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder
from decodert.export.quantize.quant import QuantConfig, WeightQuant
from decodert.export.quantize.weight_layouts import QDQ, WeightLayout
from decodert.artifact.weights import NUMPY_DTYPES
from decodert.models.layers import AttentionSpec, GatedDeltaNetSpec, Mamba2Spec, MoESpec
from decodert.models.spec import ModelSpec
from decodert.models.canonical import canonical_shape
from decodert.plugins.ops import cached_attention as ca
from decodert.plugins.ops import causal_conv as cc
from decodert.plugins.ops.encoder_attention import encoder_attention_body
from decodert.plugins.ops import gated_delta_net as gdn
from decodert.plugins.ops import mamba2_ssm as m2
from decodert.plugins.ops import kv_dtypes
from decodert.plugins.ops.kv_dtypes import KV_DTYPES, KVDtype
from decodert.plugins.ops import moe as moe_op
from decodert.plugins.ops import mrope
from decodert.plugins.ops.rms_norm import rms_norm_body


@dataclass(frozen=True)
class GraphInputs:
    input_ids: str  # [B,S] int64
    past_lengths: str  # [B] int64
    seq_lengths: str  # [B] int64
    cos_cache: str  # [max_seq, R/2] dtype
    sin_cache: str
    windows: bool = False  # the verify graph of a model with only conv states: output each conv window
    ahead: str | None = None  # [B,S] int64: later keys each query also sees (its image's; graph.py), or causal


class Lowering:
    target = "portable"
    opsets: dict[str, int] = {"": 21}
    ir_version = 10
    quant_layout: WeightLayout = QDQ  # how quantized weights are stored for this target (export/quantize/weight_layouts.py)
    # Activations between ops: [T=B*S, hidden] (Gemm takes 2-D inputs only), or [B, S, hidden]
    # where every op takes 3-D inputs: then no Reshape is needed around attention in any layer.
    flat_tokens = True
    # shapes computed from an input's values are fine (vision.onnx: the Qwen windows as a batch of windows)
    data_dependent_shapes = True

    def __init__(self, spec: ModelSpec, dtype: str, max_seq: int, quant: QuantConfig | None = None,
                 quantized: Mapping[str, WeightQuant] | None = None, kv: KVDtype | None = None):
        """``quantized``: how each weight stored quantized is stored (bits, block, symmetric), by name;
        ``kv``: the cache's element type (default: the model's dtype; plugins/ops/kv_dtypes.py)."""
        self.spec, self.dtype, self.max_seq = spec, dtype, max_seq
        self.kv = kv or KV_DTYPES[dtype]
        self.quant, self.quantized = quant, dict(quantized or {})
        self._attend(spec.attention)

    def _attend(self, attn: AttentionSpec | None) -> None:
        """Take ``attn``'s settings: the attention the ops below lower (the first attention layer's by default;
        ``for_layer`` gives each layer its own: Gemma 4's full layers have another head_dim)."""
        self.attn = attn
        self.head_dim = attn.head_dim if attn is not None else 0
        self.rotary_dim = self.spec.rope.rotary_dim or self.head_dim
        self.scale = attn.softmax_scale if attn is not None else 1.0
        self.softcap = (attn.softcap or 0.0) if attn is not None else 0.0  # 0 = none (the ONNX / ORT convention)

    @property
    def batched_past(self) -> bool:
        """Whether one call may run several tokens in several rows over non-empty caches."""
        return True

    def cacheless_attention(self) -> bool:
        """Whether ``context`` and ``attention`` also take a causal call with no cache (past names "", present
        names of scratch values): embed.onnx then runs the target's own attention kernel. The reference body
        attends over the cache it writes: no (embed.onnx uses export/lowering/embed_graph.py's attention)."""
        return False

    def kv_problem(self) -> str | None:
        """Why this lowering cannot keep its cache in ``self.kv`` (None: it can). The standard-op
        bodies store every KV dtype with Q/DQ around the cache, but float8: ScatterND (the cache
        write) has no float8 type in ONNX."""
        if self.kv.name == "fp8":
            return ("ONNX's ScatterND, the standard-op cache write, has no float8 type "
                    "(use --kv-dtype int8: the same size)")
        return None

    def kv_store(self, g: GraphBuilder, new_bhsd: str, past: str) -> str:
        """New K/V [B,Hkv,S,D] as the cache ``past`` stores it (quantized with its scale, or cast)."""
        return kv_dtypes.store_body(g, new_bhsd, kv_dtypes.scale_names(past), self.kv, self.dtype)

    def kv_load(self, g: GraphBuilder, cache: str, past: str) -> str:
        """Cache positions of ``past`` [B,Hkv,T,width] -> float K/V [B,Hkv,T,D] in the model's dtype."""
        return kv_dtypes.load_body(g, cache, kv_dtypes.scale_names(past), self.kv, self.dtype)

    def for_graph(self, kind: str) -> "Lowering":
        """The lowering one graph kind ("prefill" | "decode" | "verify") is built with (default: this one)."""
        return self

    def for_layer(self, layer: int) -> "Lowering":
        """The lowering of layer ``layer``: this one, or a copy with the layer's attention settings."""
        attn = self.spec.mixer(layer)
        if not isinstance(attn, AttentionSpec) or attn == self.attn:
            return self
        low = copy.copy(self)
        low._attend(attn)
        return low

    # ---- per-graph shared values -------------------------------------------------------------
    def context(self, g: GraphBuilder, inp: GraphInputs, window: int = 0) -> Any:
        """What every layer of one kind shares: ``window`` (0 = full) and the RoPE tables in ``inp``."""
        ctx = ca.make_context(g, inp.past_lengths, inp.input_ids, inp.cos_cache, inp.sin_cache, self.max_seq, window,
                              inp.ahead)
        tables = self.mrope(g, inp)
        if tables is None:
            return ctx
        cos, sin = (g.op("Unsqueeze", t, g.const([2])) for t in tables)  # [B,S,1,R/2]
        return dataclasses.replace(ctx, cos=cos, sin=sin)

    def mrope(self, g: GraphBuilder, inp: GraphInputs) -> tuple[str, str] | None:
        """Per-token (cos, sin) [B,S,R/2] from the 3-D positions of an M-RoPE model (plugins/ops/mrope.py), else None."""
        m = self.spec.mrope
        if m is None:
            return None
        return mrope.mrope_tables(g, inp.past_lengths, inp.input_ids, inp.cos_cache, inp.sin_cache,
                                  m.section, m.interleaved, NUMPY_DTYPES[self.dtype])

    # ---- ops ---------------------------------------------------------------------------------
    def embed(self, g: GraphBuilder, ids: str) -> str:
        """input_ids [B,S] -> rows of the embedding table [B*S, hidden] (or [B,S,hidden])."""
        return g.op("Reshape", g.op("Gather", "embed", ids, axis=0), g.const([-1, self.spec.hidden_size]))

    def tokens(self, g: GraphBuilder, x: str, width: int) -> str:
        """An activation as [T, width], whichever layout the lowering keeps."""
        return x if self.flat_tokens else g.op("Reshape", x, g.const([-1, width]))

    def rms_norm(self, g: GraphBuilder, x: str, weight: str) -> str:
        return rms_norm_body(g, x, weight, epsilon=self.spec.rms_norm_eps, dtype=self.dtype)

    def add_rms_norm(self, g: GraphBuilder, x: str, residual: str, weight: str) -> tuple[str, str]:
        """(rmsnorm(x + residual), x + residual)."""
        s = g.op("Add", residual, x)
        return self.rms_norm(g, s, weight), s

    def activation(self, g: GraphBuilder, x: str, kind: str = "silu") -> str:
        """An MLP gate's activation ``kind`` (models/layers/mlp.py ACTIVATIONS), elementwise."""
        if kind == "gelu_tanh":
            if self.opsets.get("", 0) >= 20:
                return g.op("Gelu", x, approximate="tanh")
            return gelu_tanh_body(g, x, self.dtype)
        if kind == "relu2":
            r = g.op("Relu", x)
            return g.op("Mul", r, r)
        return g.op("Mul", x, g.op("Sigmoid", x))  # silu

    def linear(self, g: GraphBuilder, x: str, weight: str, bias: str | None = None) -> str:
        """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out]."""
        if weight in self.quantized:
            return self.quantized_linear(g, x, weight, bias)
        return g.op("Gemm", x, weight, *([bias] if bias else []), transB=1)

    def quantized_linear(self, g: GraphBuilder, x: str, weight: str, bias: str | None) -> str:
        """Block DequantizeLinear of the [N, Kp] weight (axis 1), then the same Gemm."""
        wq = self.quantized[weight]
        assert not wq.block_min, "block minimums (GGUF Q4_1) are transcoded for the ort target only"
        n, k = canonical_shape(self.spec, weight)
        if wq.act_order:  # the blocks hold the inputs in group order (export/quantize/weight_layouts.py)
            x = g.op("Gather", x, f"{weight}.perm", axis=-1)
        zp = [] if wq.symmetric else [f"{weight}.zero_points"]
        w = g.op("DequantizeLinear", f"{weight}.q", f"{weight}.scales", *zp, axis=1, block_size=wq.block_size)
        if k % wq.block_size:
            w = g.op("Slice", w, g.const([0]), g.const([k]), g.const([1]))
        return g.op("Gemm", x, w, *([bias] if bias else []), transB=1)

    def moe(self, g: GraphBuilder, x: str, prefix: str, s: MoESpec, one_token_rows: bool) -> str:
        """The experts of layer ``prefix`` (plugins/ops/moe.py) on x [T, hidden] -> [T, hidden].

        ``one_token_rows`` (the decode graph) gathers the chosen experts' weights: it reads only
        those, and decoding is bound by the bytes read; prefill and verify compute every expert
        under a top-k mask, reading each expert once instead of copying k of them per token."""
        logits = self.linear(g, x, prefix + "router", prefix + "router_bias" if s.router_bias else None)
        weights, idx = moe_op.route(g, logits, s.experts_per_token, s.renormalize,
                                    None if self.dtype == "fp32" else DTYPES[self.dtype])
        ie = s.expert_size
        gate_up, down = prefix + "experts.gate_up", prefix + "experts.down"
        glu = moe_op.SwiGlu(s.swiglu_limit, s.swiglu_alpha, s.swiglu_beta)
        biases = (gate_up + "_bias", down + "_bias") if s.expert_bias else None
        if one_token_rows:
            return moe_op.gathered_body(g, x, weights, idx, ie, lambda i: self.experts(g, gate_up, i),
                                        lambda i: self.experts(g, down, i), self.activation, glu, biases)
        return moe_op.masked_body(g, x, weights, idx, s.num_experts, ie, self.experts(g, gate_up),
                                  self.experts(g, down), self.activation, glu, biases)

    def experts(self, g: GraphBuilder, name: str, idx: str | None = None) -> str:
        """Float expert matrices [E, rows, in], or the chosen ones [T, k, rows, in] for indices ``idx``.

        Quantized experts ([E * N, K] blocks, export/quantize/weight_layouts.py) are dequantized whole,
        then gathered: ONNX's Gather takes no 4-bit types,
        so the portable graph reads every expert's blocks at each step (the ort target's QMoE reads
        only the chosen ones)."""
        if name in self.quantized:
            wq = self.quantized[name]
            zp = [] if wq.symmetric else [f"{name}.zero_points"]
            w = g.op("DequantizeLinear", f"{name}.q", f"{name}.scales", *zp, axis=1, block_size=wq.block_size)
            w = g.op("Reshape", w, g.const(list(canonical_shape(self.spec, name))))  # [E * N, K] -> [E, N, K]
        else:
            w = name
        return w if idx is None else g.op("Gather", w, idx, axis=0)

    def attention(self, g: GraphBuilder, ctx: Any, qkv: str, cache: tuple[str, str, str, str],
                  sinks: str | None = None) -> str:
        """qkv [B,S,(H+2Hkv)*D] -> y [B,S,H*D]; ``sinks`` [H]: each head's sink logit (gpt-oss).

        ``cache`` = (past_key, past_value, present_key, present_value) names; the node that
        writes the cache must output the present names directly (no Identity), so a runtime can
        bind one buffer to past and present.
        """
        past_key, past_value, present_key, present_value = cache
        d, h, hkv = self.head_dim, self.attn.num_heads, self.attn.num_kv_heads
        q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
        q4 = ca.rope_body(g, g.op("Reshape", q, g.const([0, 0, h, d])), ctx, d, self.rotary_dim)
        k4 = ca.rope_body(g, g.op("Reshape", k, g.const([0, 0, hkv, d])), ctx, d, self.rotary_dim)
        v4 = g.op("Reshape", v, g.const([0, 0, hkv, d]))
        k_new = g.op("Transpose", k4, perm=[0, 2, 1, 3])  # [B,Hkv,S,D]
        v_new = g.op("Transpose", v4, perm=[0, 2, 1, 3])
        ca.write_cache_body(g, past_key, self.kv_store(g, k_new, past_key), ctx, hkv, present_key)
        ca.write_cache_body(g, past_value, self.kv_store(g, v_new, past_value), ctx, hkv, present_value)
        keys, values = self.kv_load(g, present_key, past_key), self.kv_load(g, present_value, past_value)
        return ca.attend_body(g, q4, keys, values, ctx.visible, num_heads=h, kv_heads=hkv,
                              head_dim=d, max_seq=self.max_seq, scale=self.scale, dtype=self.dtype,
                              softcap=self.softcap, sinks=sinks)

    def read_context(self, g: GraphBuilder, inp: GraphInputs, window: int = 0) -> ca.AttnContext:
        """The reference attention's context (positions, visibility, RoPE at positions) for layers that read
        another layer's cache (``shared_attention``), whichever attention this lowering's own layers use."""
        return ca.make_context(g, inp.past_lengths, inp.input_ids, inp.cos_cache, inp.sin_cache, self.max_seq, window,
                               inp.ahead)

    def shared_attention(self, g: GraphBuilder, ctx: ca.AttnContext, q: str, source: tuple[str, str, str, str]) -> str:
        """q [B,S,H*D] (normed, not rotated) over another layer's cache -> y [B,S,H*D] (Gemma 4's KV sharing).
        ``source`` = that layer's (past_key, past_value, present_key, present_value): it reads the present
        values, so it runs after that layer wrote this call's K/V, and writes nothing. The reference body on
        every target (ONNX Runtime's GroupQueryAttention and TensorRT's KV update always append K/V)."""
        past_key, past_value, present_key, present_value = source
        d, h, hkv = self.head_dim, self.attn.num_heads, self.attn.num_kv_heads
        q4 = ca.rope_body(g, g.op("Reshape", q, g.const([0, 0, h, d])), ctx, d, self.rotary_dim)
        keys, values = self.kv_load(g, present_key, past_key), self.kv_load(g, present_value, past_value)
        return ca.attend_body(g, q4, keys, values, ctx.visible, num_heads=h, kv_heads=hkv, head_dim=d,
                              max_seq=self.max_seq, scale=self.scale, dtype=self.dtype, softcap=self.softcap)

    def causal_conv(self, g: GraphBuilder, x: str, weight: str, bias: str | None, state: tuple[str, str],
                    seq_lengths: str, kernel: int, channels: int | None = None, activation: str = "none",
                    window: str | None = None) -> str:
        """Depthwise causal conv over a rolling state: x [B, C, S] -> y [B, C, S]; ``weight`` [C, 1, K], K = ``kernel``
        (plugins/ops/causal_conv.py, the op's definition):

            cat     = Concat(past [B, C, K-1], x)             the only reader of past
            y       = act(Conv(cat, weight, group=C))         (+ bias); act: "none" | "silu"
            present = cat[b, :, seq_lengths[b] .. + K-2]      each row's last K-1 valid inputs (right padding)
        ``state`` = (past, present) names: one buffer bound to both, written by GatherElements after the Concat
        read it. ``channels``: C (default hidden, LFM2's). ``window``: also output ``cat`` under that name
        (the verify graph's per-position states, docs/SPECULATIVE.md).
        """
        past, present = state
        k = kernel
        full = cc.full_window(g, x, past)
        if window:
            g.op("Identity", full, outputs=[window])
        window, w, b = full, weight, bias or ""
        if self.dtype == "bf16":  # Conv takes bfloat16 only from opset 22: compute in float32
            window, w, b = (g.op("Cast", v, to=1) if v else v for v in (full, weight, b))
        y = cc.conv_body(g, window, w, b, kernel=k, channels=channels or self.spec.hidden_size, activation=activation)
        cc.next_state(g, full, seq_lengths, k, present)
        return g.op("Cast", y, to=DTYPES["bf16"]) if self.dtype == "bf16" else y

    def gated_delta_net(self, g: GraphBuilder, qkvab: tuple[str, str, str, str, str], a_log: str, dt_bias: str,
                        state: tuple[str, str], seq_lengths: str, s: GatedDeltaNetSpec, single: bool = False) -> str:
        """The gated delta rule (plugins/ops/gated_delta_net.py) over the recurrent state [B, Hv, Dv, Dk] float32:
        q, k [B, S, Hk*Dk], v [B, S, Hv*Dv], a, b [B, S, Hv] -> y [B, S, Hv*Dv]. ``single``: S is 1 (no Loop)."""
        q, k, v, a, b = qkvab
        past, present = state
        a_log, dt_bias = self.float32(g, a_log), self.float32(g, dt_bias)
        return gdn.gated_delta_net_body(g, q, k, v, a, b, a_log, dt_bias, past, seq_lengths, present,
                                        hk=s.key_heads, hv=s.value_heads, dk=s.key_dim,
                                        dv=s.value_dim, scale=s.key_dim ** -0.5, dtype=self.dtype,
                                        single=single)

    def mamba2_ssm(self, g: GraphBuilder, xdtbc: tuple[str, str, str, str], prefix: str, state: tuple[str, str],
                   seq_lengths: str, s: Mamba2Spec, single: bool = False) -> str:
        """The Mamba2 SSM (plugins/ops/mamba2_ssm.py) over the recurrent state [B, H, N, Dh] float32: x [B, S, H*Dh],
        dt [B, S, H], b, c [B, S, G*N] -> y [B, S, H*Dh] (with the D skip); weights ``prefix`` + mamba_a_log,
        mamba_dt_bias, mamba_d. ``single``: S is 1 (no Loop)."""
        x, dt, b, c = xdtbc
        a_log, dt_bias, d = (self.float32(g, prefix + n) for n in ("mamba_a_log", "mamba_dt_bias", "mamba_d"))
        return m2.mamba2_ssm_body(g, x, dt, b, c, a_log, dt_bias, d, state[0], seq_lengths, state[1], heads=s.heads,
                                  head_dim=s.head_dim, groups=s.groups, state=s.state, dtype=self.dtype,
                                  single=single)

    def float32(self, g: GraphBuilder, x: str) -> str:
        """A model-dtype value as float32 (no node in an fp32 graph)."""
        return x if self.dtype == "fp32" else g.op("Cast", x, to=1)

    # ---- vision.onnx (export/lowering/vision_graph.py, vision_qwen.py) -------------------------------
    @classmethod
    def encoder_attention(cls, g: GraphBuilder, q: str, k: str, v: str, heads: int, head_dim: int, np_dtype: type,
                          valid: str | None = None, bias: str | None = None) -> str:
        """A vision encoder's bidirectional attention over q, k, v [B, S, H*D], ``valid`` [B, S] bool the keys
        that exist (None: all), ``bias`` [S, S] added to the scores (a window mask) -> [B, S, H*D]
        (plugins/ops/encoder_attention.py: standard ops)."""
        return encoder_attention_body(g, q, k, v, heads, head_dim, head_dim ** -0.5, np_dtype, valid, bias)

    @classmethod
    def encoder_gelu_tanh(cls, g: GraphBuilder, x: str, np_dtype: type) -> str:
        """gelu_pytorch_tanh of a vision encoder's MLP, in ops older than Gelu-20 (vision.onnx keeps opset 17)."""
        return gelu_tanh_body(g, x, DTYPE_OF[np.dtype(np_dtype)])

    # ---- an encoder-decoder's decoder.onnx (export/seq2seq_export.py; targets with Target.encoder_decoder) -------
    seq2seq_opsets: dict[str, int] = {}  # the decoder graph's opsets (empty: this lowering exports no decoder)

    @classmethod
    def seq2seq_context(cls, g: GraphBuilder, past_lengths: str, input_ids: str, max_seq: int) -> Any:
        """What every layer's self-attention reads of the step (lengths, a mask), built once per graph."""
        raise DecodertError(f"the {cls.target} lowering exports no encoder-decoder graphs")

    @classmethod
    def seq2seq_self_attention(cls, g: GraphBuilder, ctx: Any, q: str, k: str, v: str, cache: tuple[str, str, str, str],
                               past_lengths: str, heads: int, head_dim: int, max_seq: int) -> str:
        """Causal self-attention of q, k, v [B, S, H*D] over the cache (past_key, past_value, present_key,
        present_value [B, H, max_seq, D], the new K/V written at past_lengths in place) -> [B, S, H*D]."""
        raise DecodertError(f"the {cls.target} lowering exports no encoder-decoder graphs")

    @classmethod
    def seq2seq_cross_attention(cls, g: GraphBuilder, q: str, key: str, value: str, heads: int, head_dim: int) -> str:
        """q [B, S, H*D] over every row of the encoder's key / value [B, H, T, D] -> [B, S, H*D]."""
        raise DecodertError(f"the {cls.target} lowering exports no encoder-decoder graphs")


DTYPE_OF = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}


def gelu_tanh_body(g: GraphBuilder, x: str, dtype: str) -> str:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in standard ops older than Gelu-20."""
    c = lambda v: g.const(np.array(v, NUMPY_DTYPES[dtype]))  # noqa: E731
    inner = g.op("Mul", g.op("Add", x, g.op("Mul", g.op("Mul", g.op("Mul", x, x), x), c(0.044715))),
                 c(np.sqrt(2.0 / np.pi)))
    return g.op("Mul", g.op("Mul", x, c(0.5)), g.op("Add", g.op("Tanh", inner), c(1.0)))
