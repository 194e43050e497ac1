"""The ``trt`` target: standard ONNX ops TensorRT (>= 10.15, TensorRT-RTX) maps to native layers.

- RMSNorm          -> RMSNormalization-23
- CachedAttention  -> RotaryEmbedding-23 (q, k)  -> ROTARY_EMBEDDING
                      TensorScatter-24 into past  -> KV_CACHE_UPDATE (in place)
                      Attention-23 over the whole [B,Hkv,Smax,D] cache with a bool mask
                      [B,1,S,Smax] built from past_lengths (no past inputs: TensorRT rejects them);
                      fp32 graphs and soft-capped attention (Gemma 2) use the decomposed attention
                      body instead (see below)
The same graph runs on ONNX Runtime CPU in tests.

An encoder-decoder's decoder.onnx (Whisper, export/seq2seq_export.py): self-attention = TensorScatter-24 of the
new K/V at past_lengths + the decomposed attention over the whole [B,H,S_max,D] cache under the causal mask
(fp32 graphs: TensorRT has no fp32 Attention kernel); cross-attention = MatMul, Softmax, MatMul over the
encoder's [B,H,T,D] K/V (no mask: every row of the window is a key).

With ``plugins`` (``--plugins always``, or ``auto`` for a TensorRT without those layers, e.g.
Jetson JetPack 6 = 10.3 / JetPack 7.1 = 10.13), the ops listed become ``decodert::`` plugin nodes
served by TensorRT plugins (plugins/trt/creators.py) and the graph drops to opset 17:
- RMSNorm          -> decodert::RMSNorm (x, weight[, residual]) -> (y[, sum])
- CachedAttention  -> decodert::CachedAttention (q, k, v, past_key, past_value, past_lengths,
                      cos, sin) -> (y, present_key, present_value): its outputs are the graph's
                      present_* outputs, in place (the plugin aliases them to the past inputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodert.errors import DecodertError
from decodert.export.lowering.lowering import GraphInputs, Lowering
from decodert.plugins.onnx_builder import GraphBuilder
from decodert.export.quantize.quant import QuantConfig, WeightQuant
from decodert.models.layers import AttentionSpec
from decodert.models.spec import ModelSpec
from decodert.plugins.ops.cached_attention import attend_body, positions_and_visibility
from decodert.plugins.ops.kv_dtypes import KVDtype
from decodert.plugins.registry import DOMAIN, OPSET_VERSION
from decodert.plugins.selection import PLUGIN_OPS  # the ops the trt target can emit as plugin nodes

PLUGIN_OPSET = 17  # what TensorRT 8.6 .. 10.x parsers all read; the rest of the graph needs no more


@dataclass(frozen=True)
class TrtContext:
    positions: str  # [B,S] int64 ("" with M-RoPE: cos/sin per token [B,S,R/2])
    write_index: str  # [B] int64 (= past_lengths)
    visible: str  # [B,1,S,Smax] bool
    cos_cache: str  # [max_seq, R/2]
    sin_cache: str


@dataclass(frozen=True)
class PluginContext:
    """The plugin derives positions and the mask from past_lengths itself; it needs the names and window."""

    past_lengths: str  # [B] int64
    cos_cache: str  # [max_seq, R/2]
    sin_cache: str
    window: int  # 0 = full attention


class TrtLowering(Lowering):
    target = "trt"
    opsets = {"": 24}
    ir_version = 11
    # TensorRT cannot bound a shape computed from an input's values (the Qwen windows' count: Myelin fails its
    # int32 dimension check): vision.onnx attends over all patches with a [P, P] window mask instead
    data_dependent_shapes = False

    def __init__(self, spec: ModelSpec, dtype: str, max_seq: int, quant: QuantConfig | None = None,
                 quantized: Mapping[str, WeightQuant] | None = None, kv: KVDtype | None = None,
                 plugins: tuple[str, ...] = ()):
        super().__init__(spec, dtype, max_seq, quant, quantized, kv)
        unknown = set(plugins) - set(PLUGIN_OPS)
        if unknown:
            raise ValueError(f"no trt plugin lowering for {sorted(unknown)}; known: {PLUGIN_OPS}")
        self.plugins = tuple(op for op in PLUGIN_OPS if op in plugins)
        attention = [a for a in (spec.mixer(i) for i in range(spec.num_layers)) if isinstance(a, AttentionSpec)]
        if "CachedAttention" in self.plugins and spec.mrope is not None:
            raise DecodertError(f"{spec.family}'s M-RoPE has no CachedAttention plugin kernel; export it for a "
                                "TensorRT with native attention layers (>= 10.15, --plugins never) or --target ort")
        if "CachedAttention" in self.plugins and any(a.softcap or a.sinks for a in attention):
            what = "soft-capping" if any(a.softcap for a in attention) else "sinks"
            raise DecodertError(f"{spec.family}'s attention {what} has no CachedAttention plugin kernel; "
                                "export it for a TensorRT with native attention layers (>= 10.15, --plugins never) "
                                "or for --target ort")
        if "CachedAttention" in self.plugins and spec.images is not None and spec.images.bidirectional:
            raise DecodertError(f"{spec.family}'s bidirectional attention within an image has no CachedAttention "
                                "plugin kernel; export it for a TensorRT with native attention layers (--plugins never)")
        if self.plugins:  # block DequantizeLinear (quantized weights) needs opset 21
            self.opsets = {"": 21 if quantized else PLUGIN_OPSET, DOMAIN: OPSET_VERSION}
            self.ir_version = 10 if quantized else 8

    seq2seq_opsets = {"": 24}  # TensorScatter

    @classmethod
    def seq2seq_context(cls, g: GraphBuilder, past_lengths: str, input_ids: str, max_seq: int) -> Any:
        """visible [B,1,S,S_max] bool: key j <= the query's position (past + arange(S))."""
        return positions_and_visibility(g, past_lengths, input_ids, max_seq)[1]

    @classmethod
    def seq2seq_self_attention(cls, g: GraphBuilder, ctx: Any, q: str, k: str, v: str, cache: tuple[str, str, str, str],
                               past_lengths: str, heads: int, head_dim: int, max_seq: int) -> str:
        past_key, past_value, present_key, present_value = cache
        to_bhsd = lambda x: g.op("Transpose", g.op("Reshape", x, g.const([0, 0, heads, head_dim])), perm=[0, 2, 1, 3])  # noqa: E731
        g.op("TensorScatter", past_key, to_bhsd(k), past_lengths, axis=2, outputs=[present_key])
        g.op("TensorScatter", past_value, to_bhsd(v), past_lengths, axis=2, outputs=[present_value])
        q4 = g.op("Reshape", q, g.const([0, 0, heads, head_dim]))
        return attend_body(g, q4, present_key, present_value, ctx, num_heads=heads, kv_heads=heads, head_dim=head_dim,
                           max_seq=max_seq, scale=head_dim ** -0.5, dtype="fp32")

    @classmethod
    def seq2seq_cross_attention(cls, g: GraphBuilder, q: str, key: str, value: str, heads: int, head_dim: int) -> str:
        q4 = g.op("Transpose", g.op("Reshape", q, g.const([0, 0, heads, head_dim])), perm=[0, 2, 1, 3])  # [B,H,S,D]
        scores = g.op("MatMul", g.op("Mul", q4, g.const(np.float32(head_dim ** -0.5))),
                      g.op("Transpose", key, perm=[0, 1, 3, 2]))  # [B,H,S,T]
        y = g.op("MatMul", g.op("Softmax", scores, axis=-1), value)  # [B,H,S,D]
        return g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 1, 3]), g.const([0, 0, heads * head_dim]))

    def kv_problem(self) -> str | None:
        if self.kv.storage == self.dtype:
            return None
        return (f"TensorRT's KV cache update layer (TensorScatter; TensorRT-RTX 1.7) takes only a float, half or "
                f"bfloat16 cache of the activations' type, not {self.kv.name}; export --target trt with "
                f"--kv-dtype {self.dtype}, or use --target ort for a quantized cache")

    def context(self, g: GraphBuilder, inp: GraphInputs, window: int = 0) -> TrtContext | PluginContext:
        if "CachedAttention" in self.plugins:
            return PluginContext(inp.past_lengths, inp.cos_cache, inp.sin_cache, window)
        with g.scope("attn_context"):
            pos, visible = positions_and_visibility(g, inp.past_lengths, inp.input_ids, self.max_seq, window, inp.ahead)
        tables = self.mrope(g, inp)  # M-RoPE: per-token tables, RotaryEmbedding without position ids
        if tables is not None:
            return TrtContext("", inp.past_lengths, visible, *tables)
        return TrtContext(pos, inp.past_lengths, visible, inp.cos_cache, inp.sin_cache)

    def rms_norm(self, g: GraphBuilder, x: str, weight: str) -> str:
        if "RMSNorm" in self.plugins:
            # two outputs always (the second is x here): a TensorRT plugin's output count is fixed
            return g.op("RMSNorm", x, weight, domain=DOMAIN, epsilon=self.spec.rms_norm_eps, outputs=2)[0]
        return g.op("RMSNormalization", x, weight, axis=-1, epsilon=self.spec.rms_norm_eps, stash_type=1)

    def add_rms_norm(self, g: GraphBuilder, x: str, residual: str, weight: str) -> tuple[str, str]:
        if "RMSNorm" not in self.plugins:
            return super().add_rms_norm(g, x, residual, weight)
        y, s = g.op("RMSNorm", x, weight, residual, domain=DOMAIN, epsilon=self.spec.rms_norm_eps, outputs=2)
        return y, s

    def _rope(self, g: GraphBuilder, x: str, heads: int, ctx: TrtContext) -> str:
        return g.op("RotaryEmbedding", x, ctx.cos_cache, ctx.sin_cache, ctx.positions, num_heads=heads, interleaved=0,
                    rotary_embedding_dim=self.rotary_dim if self.rotary_dim != self.head_dim else None)

    def attention(self, g: GraphBuilder, ctx: Any, qkv: str, cache: tuple[str, str, str, str],
                  sinks: str | None = None) -> str:
        s = self.attn
        past_key, past_value, present_key, present_value = cache
        d, h, hkv = self.head_dim, s.num_heads, s.num_kv_heads
        q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
        if "CachedAttention" in self.plugins:  # [B,S,H*D], present_* written in place
            return g.op("CachedAttention", q, k, v, past_key, past_value, ctx.past_lengths, ctx.cos_cache,
                        ctx.sin_cache, domain=DOMAIN, outputs=[None, present_key, present_value],
                        num_heads=h, kv_num_heads=hkv, scale=self.scale, sliding_window=ctx.window)[0]
        q = self._rope(g, q, h, ctx)
        k = self._rope(g, k, hkv, ctx)
        to_bhsd = lambda x, n: g.op("Transpose", g.op("Reshape", x, g.const([0, 0, n, d])), perm=[0, 2, 1, 3])  # noqa: E731
        g.op("TensorScatter", past_key, to_bhsd(k, hkv), ctx.write_index, axis=2, outputs=[present_key])
        g.op("TensorScatter", past_value, to_bhsd(v, hkv), ctx.write_index, axis=2, outputs=[present_value])
        if self.dtype == "fp32" or self.softcap or sinks:
            # TensorRT has no dedicated fp32 attention kernel and rejects Attention-23 unless it carries
            # a TensorRT-only attribute ONNX Runtime refuses; its Attention also rejects softcap (Gemma 2,
            # TensorRT-RTX 1.7) and has no sinks (gpt-oss). The decomposed body builds (and fuses).
            q4 = g.op("Reshape", q, g.const([0, 0, h, d]))
            return attend_body(g, q4, present_key, present_value, ctx.visible, num_heads=h, kv_heads=hkv,
                               head_dim=d, max_seq=self.max_seq, scale=self.scale, dtype=self.dtype,
                               softcap=self.softcap, sinks=sinks)
        y = g.op("Attention", to_bhsd(q, h), present_key, present_value, ctx.visible, scale=self.scale)
        return g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 1, 3]), g.const([0, 0, h * d]))
