"""The small interface between the generate loop and an execution backend (ort | trt).

The loop owns *what* to run (which slots, which tokens); a backend owns *how* (bound buffers,
sessions or engines). Nothing here imports onnxruntime or tensorrt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from decodert.runtime.backends.kv_cache import KVCache  # the one cache class every backend allocates (runtime/backends/kv_cache.py)


@dataclass
class StepOutput:
    """Result of one prefill or decode call, rows in the order of the ``slots`` argument."""

    next_token: np.ndarray  # [n] int64, argmax of the logits (computed on the graph / device)
    logits: np.ndarray | None = None  # [n, V] float32, when asked for (or given for rows whose next_token's score
    #                                   is NaN / inf; the other rows then read 0: see generate.choose_tokens)


@dataclass
class VerifyOutput:
    """Result of one verify call (speculative decoding), rows in the order of the ``slots`` argument."""

    next_tokens: np.ndarray  # [n, W] int64: next_tokens[j, i] is the argmax after row j's token i
    logits: np.ndarray | None = None  # [n, W, V] float32, when asked for (or given, as StepOutput.logits)
    # hybrid models whose states are all conv states, where the backend binds the verify graph's windows:
    # per row, state name -> [C, K-1+w] the conv inputs before and of the pass (the state after accepting
    # a tokens is [:, a : a+K-1]); None: the backend gives none (speculation replays instead)
    windows: list[dict[str, np.ndarray]] | None = None


class Backend(Protocol):
    name: str  # "ort" | "trt"
    max_batch: int  # slots one cache can hold
    max_seq: int  # tokens one slot can hold (prompt + generated)
    vocab_size: int

    def allocate(self, slots: int) -> KVCache:
        """Allocate the cache once (raises DecodertError naming --max-seq/--max-batch if it won't fit)."""
        ...

    def prefill(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> StepOutput:
        """Append each row's new tokens ``ids[j]`` (1-D int64) to slot ``slots[j]``.

        Writes at ``cache.lengths[slot]`` and ``cache.commit``s the ids; returns the output for each
        row's last token. Rows may have different lengths (the backend pads).
        """
        ...

    def decode(self, cache: KVCache, slots: Sequence[int], ids: np.ndarray, want_logits: bool) -> StepOutput:
        """One token per slot (``ids`` [n] int64), committed to each slot's row."""
        ...

    def verify(self, cache: KVCache, slots: Sequence[int], ids: Sequence[np.ndarray], want_logits: bool) -> VerifyOutput:
        """Append each row's tokens ``ids[j]`` (1-D, 1..verify_width) like prefill, but return the
        output after every one of them (W = the longest row; a shorter row's tail is padding).

        Optional (speculative decoding); rejected tokens are dropped by ``cache.rewind``: the next
        write overwrites them, nothing is copied.
        """
        ...

    def prepare_verify(self, rows: int) -> None:
        """With ``verify``: open what a verify pass of ``rows`` rows needs (ONNX Runtime: the multi-row
        verify session, 1.5-1.8 s for SmolLM2 fp32; TensorRT: the verify engine), so that a pass the
        speculation planner chooses later does not stall a stream or a timed run. Idempotent."""
        ...

    def move_slot(self, cache: KVCache, src: int, dst: int) -> None:
        """Copy slot ``src``'s cached positions into ``dst`` and ``cache.move`` the record: ``dst`` holds
        what ``src`` held, ``src`` nothing (to keep active rows compact)."""
        ...

    # -- KV blocks (runtime/backends/kv_blocks.py): what the prefix cache keeps between requests ----------
    def kv_bytes(self, n: int) -> int:
        """Bytes of the K/V of ``n`` positions over all layers (one block of ``n`` tokens)."""
        ...

    def read_kv(self, cache: KVCache, slot: int, start: int, n: int) -> Any:
        """A copy of positions [start, start+n) of ``slot``, kept where the cache lives (host or device)."""
        ...

    def write_kv(self, cache: KVCache, slot: int, start: int, block: Any) -> None:
        """Copy a block from ``read_kv`` into positions [start, start+n) of ``slot`` (lengths unchanged)."""
        ...

    def free_kv(self, block: Any) -> None:
        """Release a block's memory now (device memory; a host block just loses its reference)."""
        ...

    def kv_to_bytes(self, block: Any) -> np.ndarray:
        """A block's bytes on the host [nbytes] uint8, one layout for host and device blocks (kv_blocks.host_bytes):
        what the prefix cache's disk tier writes. Optional: without it (and ``kv_from_bytes``) no disk tier."""
        ...

    def kv_from_bytes(self, cache: KVCache, data: np.ndarray, n: int) -> Any:
        """``kv_to_bytes``' inverse: a block of ``n`` positions for ``write_kv`` into ``cache``; ValueError when
        ``data`` is not that size."""
        ...


def window_outputs(manifest: Any) -> dict[str, int]:
    """State name ("conv.3") -> K-1 for each conv window the verify graph outputs (``window_conv.3``;
    export/lowering/graph.py: models whose every state is a conv state); {} otherwise."""
    graph = manifest.graphs.get("verify")
    names = {t.name for t in graph.outputs} if graph is not None else set()
    return {st.io_name: int(st.shape[-1]) for st in manifest.kv.states if f"window_{st.io_name}" in names}
