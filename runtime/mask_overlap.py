"""A batch's next-step token masks, computed on a worker thread while the backend's step runs.

ONNX Runtime and llguidance's mask computation both release the GIL, so ``masks_ahead(seqs)`` around a
backend step fills the guided rows' bitmasks meanwhile, when the last step's masks took at least
``OVERLAP_MIN_S``; a guide whose mask is stale computes it when it is needed, so the overlap is a
speed-up only, never a condition for correctness (runtime/constraints.py owns the guides).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from decodert.runtime.constraints import Guide, _llguidance

_pool: ThreadPoolExecutor | None = None
_executor: Any = None
_pool_lock = threading.Lock()
OVERLAP = True  # compute next-step masks on a worker thread while the backend runs (bench/structured.py)
# Masks that took less than this (all rows together, last step) are computed inline after the
# step instead. Measured (docs/benchmarks/history.md, "Structured output"): a JSON mask takes 10-20 us per row, so overlapping
# it could save < 0.1% of a step, less than the thread hand-off (~15 us) and the risk of taking a
# core from ONNX Runtime's threads; a fresh grammar's first masks (up to ~6 ms) are overlapped.
OVERLAP_MIN_S = 1e-3


def _workers() -> tuple[ThreadPoolExecutor, Any]:
    global _pool, _executor
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decodert-masks")
            _executor = _llguidance().LLExecutor()
        return _pool, _executor


def compute_masks(guides: Sequence[Guide]) -> None:
    """Fill the stale masks of several rows (in parallel over rows for more than one)."""
    stale = [g for g in guides if g.stale]
    if len(stale) == 1:
        stale[0].compute_mask()
    elif stale:
        words = stale[0].mask.size
        masks = np.zeros((len(stale), words), np.int32)  # [rows, words], one buffer for the executor
        start = time.perf_counter()
        _workers()[1].unsafe_compute_mask_ptr([(g.matcher, k) for k, g in enumerate(stale)],
                                              masks.ctypes.data, words * 4, len(stale))
        share = (time.perf_counter() - start) / len(stale)
        for k, g in enumerate(stale):
            g.set_mask(masks[k], share)


@contextmanager
def masks_ahead(seqs: Iterable[Any]) -> Iterator[None]:
    """Around a backend step: the guided rows' next masks are computed on a worker thread meanwhile.

    ``seqs`` are objects with a ``guide`` attribute (Guide or None). On exit the worker is
    joined (also when the step raised), so the masks are ready and no thread touches a matcher.
    """
    guides = [s.guide for s in seqs if getattr(s, "guide", None) is not None and s.guide.stale]
    if not guides or not OVERLAP or sum(g.mask_s for g in guides) < OVERLAP_MIN_S:
        yield
        return
    job = _workers()[0].submit(compute_masks, guides)
    try:
        yield
    finally:
        job.result()
