"""LoRA adapters in the graph: stacked slot weights (runtime inputs) and a per-row slot index.

Layout of the inputs: artifact/lora_layout.py. Per adapted linear (every qkv, o, gate_up, down), in
standard ONNX ops only (so every target that takes LoRA inputs lowers it the same way):

    lora_index [B] --Equal(1..N)--> one-hot [B, N] --Expand--> mask [B, 1, P*N*R] | [T, P*N*R]  (once per P)
    t      = x @ lora_a.{i}.{target}^T         [.., P*N*R]  every slot's A at once
    t      = t * mask                          only each row's own slot survives (0 / out of range: none)
    delta  = concat_p(t_p @ lora_b.{i}.{p}^T)  [.., out]    t split per part (q, k, v / gate, up)
    y      = base(x) + delta

Reading every slot's A and B each step costs what gathering each row's would not, but nothing is copied,
and a batch of rows with different adapters is one call. ONNX Runtime fuses each weight's Transpose into
its MatMul (FusedMatMul, transB); putting the weights on the left instead (``A @ x^T``, so that a GEMM
packs only the token columns) measured the same on SmolLM2 (157 vs 160 ms per batch-4 step, 1 thread),
with four more ops per linear, so the simpler form stays.
"""

from __future__ import annotations

import numpy as np

from decodert.artifact.lora_layout import TARGET_PARTS, LoraLayout
from decodert.models.spec import ModelSpec
from decodert.plugins.onnx_builder import DTYPES, GraphBuilder

LORA_INDEX = "lora_index"


class LoraGraph:
    """The LoRA values one graph shares (the per-token masks, output shapes), and the per-linear update."""

    def __init__(self, g: GraphBuilder, layout: LoraLayout, spec: ModelSpec, dtype: str, input_ids: str,
                 flat_tokens: bool) -> None:
        self.g, self.layout, self.spec, self.dtype = g, layout, spec, dtype
        self.input_ids, self.flat_tokens = input_ids, flat_tokens
        self._masks: dict[int, str] = {}
        with g.scope("lora"):
            n = layout.slots
            hit = g.op("Equal", g.op("Unsqueeze", LORA_INDEX, g.const([1])), g.const(np.arange(1, n + 1, dtype=np.int64)))
            self.one_hot = g.op("Cast", hit, to=DTYPES[dtype])  # [B, N]

    def mask(self, parts: int) -> str:
        """[B, 1, P*N*R] (3-D activations) or [T, P*N*R] (flat): 1 on the columns of each row's own slot."""
        if parts not in self._masks:
            g, n, r = self.g, self.layout.slots, self.layout.rank
            with g.scope("lora"), g.scope(f"mask{parts}"):
                m = g.op("Expand", g.op("Reshape", self.one_hot, g.const([-1, 1, n, 1])), g.const([1, parts, 1, r]))
                m = g.op("Reshape", m, g.const([-1, 1, parts * n * r]))  # [B, 1, P*N*R]
                if self.flat_tokens:  # one row per token: [B, S, PNR] -> [T, PNR]
                    shape = g.op("Concat", g.op("Shape", self.input_ids), g.const([parts * n * r]), axis=0)
                    m = g.op("Reshape", g.op("Expand", m, shape), g.const([-1, parts * n * r]))
            self._masks[parts] = m
        return self._masks[parts]

    def add(self, x: str, y: str, layer: int, target: str) -> str:
        """``y`` (the base linear's output of ``x``) plus each row's adapter update."""
        g, parts = self.g, TARGET_PARTS[target]
        nr = self.layout.slots * self.layout.rank
        with g.scope("lora"):
            t = g.op("MatMul", x, g.op("Transpose", f"lora_a.{layer}.{target}", perm=[1, 0]))  # [.., PNR]
            t = g.op("Mul", t, self.mask(len(parts)))
            chunks = [t] if len(parts) == 1 else g.op("Split", t, g.const([nr] * len(parts)), axis=-1, outputs=len(parts))
            deltas = [g.op("MatMul", c, g.op("Transpose", f"lora_b.{layer}.{p}", perm=[1, 0])) for c, p in zip(chunks, parts)]
            return g.op("Add", y, deltas[0] if len(deltas) == 1 else g.op("Concat", *deltas, axis=-1))
