"""Memory checks done before allocating: refuse clearly instead of being killed later."""

from __future__ import annotations

import resource
from collections.abc import Sequence
import sys

from decodert.errors import DecodertError
from decodert.plugins.ops.kv_dtypes import KVDtype


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """Refuse (before allocating) what would take more than 90% of the memory available now."""
    avail = available_bytes()
    if avail is not None and nbytes > 0.9 * avail:
        raise DecodertError(f"{what} needs {_size(nbytes)} but only {_size(avail)} is available; "
                            f"export with a lower --max-seq or --max-batch{hint}")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def kv_cache_bytes(slots: int, max_seq: int, layers: int, kv_heads: int, head_dim: int | Sequence[int],
                   kv: KVDtype) -> int:
    """Bytes of a KV cache of ``slots`` rows: K and V per layer, [slots, Hkv, max_seq, D] in ``kv``'s element size;
    ``head_dim``: one D for every layer, or each layer's."""
    dims = [head_dim] * layers if isinstance(head_dim, int) else list(head_dim)
    return slots * 2 * kv_heads * max_seq * sum(kv.bytes_per_position(d) for d in dims)


def check_kv_fits(nbytes: int, kv: KVDtype) -> None:
    """``check_fits`` for a KV cache: the message names its dtype, and a smaller one where there is."""
    hint = "" if kv.bits <= 8 else f", or a smaller --kv-dtype (int8: {kv.bits // 8}x less than {kv.name})"
    check_fits(nbytes, f"the {kv.name} KV cache", hint)


def check_weights_fit(nbytes: int, experts: int = 0, active: int = 0) -> None:
    """Refuse weights that would not fit, before a session loads them. ``nbytes`` is the whole weights
    file: a mixture-of-experts model (``experts`` per MoE layer, ``active`` of them per token) holds every
    expert (the memory is the total parameters, while a decode step reads only the active ones), and the
    message says so."""
    what = "the weights" + (f" (all {experts} experts of each MoE layer, not only the "
                            f"{active} a token uses)" if experts else "")
    avail = available_bytes()
    if avail is not None and nbytes > 0.9 * avail:
        raise DecodertError(f"{what} need {nbytes / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB is available; "
                            "export with --quant int4 or use a smaller model")


def current_rss_bytes() -> int | None:
    """Resident set size now (Linux /proc/self/statm), None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024
