"""Each layer kind's lowering, by kind (models/layers/): the graph recipe (export/lowering/graph.py) looks a
layer's mixer and MLP up here and never branches on a kind.

    mixer(g, lowering, attention context, inputs, spec, layer, normed input, linear) -> output before the
          residual add; it writes the layer's cache or states
    mlp(g, lowering, spec, layer, normed input, linear, one_token_rows) -> output before the residual add
``linear(x, target, bias)``: the layer's linears, with each row's LoRA update (export/lowering/lora_graph.py).
"""

from __future__ import annotations

from typing import Callable

from decodert.export.lowering.layers import attention, delta_net, mamba2, mlp, moe, short_conv

MIXERS: dict[str, Callable[..., str]] = {"attention": attention.mixer, "conv": short_conv.mixer,
                                         "linear_attention": delta_net.mixer, "mamba2": mamba2.mixer}
MLPS: dict[str, Callable[..., str]] = {"dense": mlp.mlp, "moe": moe.mlp}
