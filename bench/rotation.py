"""The repeat loop of the comparison benchmarks (bench/compare.py, bench/sizes.py): every run once per
repeat, the runs of a group alternating with the first rotating, so that a drift of the machine (load,
caches, clocks) falls on every runtime alike."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def rotate(groups: Sequence[Sequence[int]], repeats: int, run: Callable[[int], T],
           log: Callable[[str], None]) -> dict[int, list[T]]:
    """``run(i)`` for every index of every group, ``repeats`` times -> {i: results}. Within a group the
    order rotates each repeat. An index whose run fails (RuntimeError, a worker timeout, ValueError) is
    logged and dropped from the result."""
    runs: dict[int, list[T]] = {i: [] for g in groups for i in g}
    failed: set[int] = set()
    for r in range(repeats):
        for members in groups:
            order = list(members[r % len(members):]) + list(members[: r % len(members)])
            for i in (i for i in order if i not in failed):
                try:
                    runs[i].append(run(i))
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                    log(f"  {e}")
                    failed.add(i)
        log(f"  repeat {r + 1}/{repeats} done at {time.strftime('%H:%M:%S')} (load {os.getloadavg()[0]:.2f})")
    return {i: v for i, v in runs.items() if v and i not in failed}
