"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): rotary angles from 3-D positions (t, h, w).

    position[a, b, s] = past_lengths[b] + s + rope_offsets[a, b, s]       a = t, h, w   [3, B, S]
    cos[b, s, j]      = cos_cache[position[axis(j), b, s], j]              j < R/2 (one per rotary pair)
      sections (Qwen2.5-VL, mrope_section (s_t, s_h, s_w)):  j < s_t -> t,  j < s_t + s_h -> h,  else w
      interleaved (Qwen3-VL):  j % 3 == 1 and j < 3 s_h -> h,  j % 3 == 2 and j < 3 s_w -> w,  else t

A text token's offsets are equal on the three axes (0 before the first image), so a text-only row is
ordinary RoPE; image tokens get (t, row, column) positions. The runtime computes the offsets from the
ids a cache row holds (runtime/vision/mrope.py), so they need no state of their own. The graph picks
each pair's axis with a one-hot mask (exact: x * 1 + 0 + 0), then the lowering rotates with per-token
tables [B, S, R/2]: the rotate-half body (portable), or RotaryEmbedding-23 without position_ids (trt, ort's
verify graph). ort's GroupQueryAttention graphs rotate q and k with com.microsoft.MRotaryEmbedding over the
3-D positions instead (one op each per layer; its CPU kernel equals ``mrope_ref``, both layouts).
"""

from __future__ import annotations

import numpy as np

from decodert.plugins.onnx_builder import GraphBuilder

OFFSETS = "rope_offsets"  # the graph input [3, B, S] int64 (default zeros [3, 1, 1])


def axis_of_pairs(sections: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """[R/2] the axis (0 t, 1 h, 2 w) each rotary pair turns by, as transformers assigns them."""
    half = sum(sections)
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    axis = np.zeros(half, np.int64)
    for a in (1, 2):
        axis[a : 3 * sections[a] : 3] = a
    return axis


def mrope_ref(positions: np.ndarray, cos_cache: np.ndarray, sin_cache: np.ndarray, sections: tuple[int, ...],
              interleaved: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """positions [3, B, S] -> cos, sin [B, S, R/2] (numpy reference)."""
    axis = axis_of_pairs(sections, interleaved)
    cols = np.arange(len(axis))[:, None, None]
    return cos_cache[positions[axis], cols].transpose(1, 2, 0), sin_cache[positions[axis], cols].transpose(1, 2, 0)


def positions3(g: GraphBuilder, past_lengths: str, input_ids: str) -> str:
    """position [3, B, S] int64 = past_lengths + arange(S) + rope_offsets."""
    with g.scope("mrope"):
        seq = g.op("Gather", g.op("Shape", input_ids), g.const(np.array(1, np.int64)), axis=0)
        steps = g.op("Unsqueeze", g.op("Range", g.const(np.array(0, np.int64)), seq, g.const(np.array(1, np.int64))), g.const([0]))
        pos = g.op("Add", g.op("Unsqueeze", past_lengths, g.const([1])), steps)  # [B, S]
        return g.op("Add", g.op("Unsqueeze", pos, g.const([0])), OFFSETS)  # [3, B, S]


def mrope_tables(g: GraphBuilder, past_lengths: str, input_ids: str, cos_cache: str, sin_cache: str,
                 sections: tuple[int, ...], interleaved: bool, np_dtype: type) -> tuple[str, str]:
    """Per-token (cos, sin) [B, S, R/2] from ``rope_offsets``, in the tables' dtype."""
    pos3 = positions3(g, past_lengths, input_ids)
    with g.scope("mrope"):
        axis = axis_of_pairs(sections, interleaved)
        onehot = (np.arange(3)[:, None] == axis[None, :]).astype(np_dtype).reshape(3, 1, 1, -1)  # [3, 1, 1, R/2]
        mask = g.const(onehot)
        out = []
        for table in (cos_cache, sin_cache):
            rows = g.op("Gather", table, pos3, axis=0)  # [3, B, S, R/2]
            out.append(g.op("ReduceSum", g.op("Mul", rows, mask), g.const([0]), keepdims=0))
        return out[0], out[1]
