"""The ``trt`` target: standard ONNX ops TensorRT (>= 10.15, TensorRT-RTX) maps to native layers.

- RMSNorm          -> RMSNormalization-23
- CachedAttention  -> RotaryEmbedding-23 (q, k)  -> ROTARY_EMBEDDING
                      TensorScatter-24 into past  -> KV_CACHE_UPDATE (in place)
                      Attention-23 over the whole [B,Hkv,Smax,D] cache with a bool mask
                      [B,1,S,Smax] built from past_lengths (no past inputs: TensorRT rejects them)
The same graph runs on ONNX Runtime CPU in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decodert.export.lowering import GraphInputs, Lowering
from decodert.export.onnx_builder import GraphBuilder
from decodert.plugins.cached_attention import positions_and_visibility


@dataclass(frozen=True)
class TrtContext:
    positions: str  # [B,S] int64
    write_index: str  # [B] int64 (= past_lengths)
    visible: str  # [B,1,S,Smax] bool
    cos_cache: str  # [max_seq, R/2]
    sin_cache: str


class TrtLowering(Lowering):
    target = "trt"
    opsets = {"": 24}
    ir_version = 11

    def context(self, g: GraphBuilder, inp: GraphInputs) -> TrtContext:
        with g.scope("attn_context"):
            pos, visible = positions_and_visibility(g, inp.past_lengths, inp.input_ids, self.max_seq,
                                                    self.spec.sliding_window or 0)
        return TrtContext(pos, inp.past_lengths, visible, inp.cos_cache, inp.sin_cache)

    def rms_norm(self, g: GraphBuilder, x: str, weight: str) -> str:
        return g.op("RMSNormalization", x, weight, axis=-1, epsilon=self.spec.rms_norm_eps, stash_type=1)

    def _rope(self, g: GraphBuilder, x: str, heads: int, ctx: TrtContext) -> str:
        return g.op("RotaryEmbedding", x, ctx.cos_cache, ctx.sin_cache, ctx.positions, num_heads=heads, interleaved=0,
                    rotary_embedding_dim=self.rotary_dim if self.rotary_dim != self.spec.head_dim else None)

    def attention(self, g: GraphBuilder, ctx: Any, qkv: str, cache: tuple[str, str, str, str]) -> str:
        s = self.spec
        past_key, past_value, present_key, present_value = cache
        d, h, hkv = s.head_dim, s.num_heads, s.num_kv_heads
        q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d]), axis=2, outputs=3)
        q = self._rope(g, q, h, ctx)
        k = self._rope(g, k, hkv, ctx)
        to_bhsd = lambda x, n: g.op("Transpose", g.op("Reshape", x, g.const([0, 0, n, d])), perm=[0, 2, 1, 3])  # noqa: E731
        g.op("TensorScatter", past_key, to_bhsd(k, hkv), ctx.write_index, axis=2, outputs=[present_key])
        g.op("TensorScatter", past_value, to_bhsd(v, hkv), ctx.write_index, axis=2, outputs=[present_value])
        y = g.op("Attention", to_bhsd(q, h), present_key, present_value, ctx.visible, scale=self.scale)
        return g.op("Reshape", g.op("Transpose", y, perm=[0, 2, 1, 3]), g.const([0, 0, h * d]))
