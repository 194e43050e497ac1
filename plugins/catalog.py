"""Every decodert op, imported: ``get_op(name)`` and ``load_all()``.

The op modules register themselves in ``registry.OPS`` on import; this module imports them all, so
nothing below it needs a lazy import back up (registry -> op module -> registry would be a cycle).
"""

from __future__ import annotations

from decodert.errors import DecodertError
from decodert.plugins.ops import cached_attention, causal_conv, gated_delta_net, mamba2_ssm, rms_norm, weight_gemm  # noqa: F401,E501  (they register on import)
from decodert.plugins.registry import DOMAIN, OPS, OpDef


def get_op(name: str, node_name: str = "?") -> OpDef:
    if name not in OPS:
        raise DecodertError(f"node {node_name}: unknown op {DOMAIN}::{name}; known: {', '.join(sorted(OPS))}")
    return OPS[name]


def load_all() -> dict[str, OpDef]:
    """Every registered op by name."""
    return OPS
