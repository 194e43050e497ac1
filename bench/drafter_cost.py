"""Cost of prompt lookup's proposal per row and step (the host work beside every speculative pass).

    python bench/drafter_cost.py ARTIFACT [--gen 128] [--draft-len 8]

Replays decodert's plain greedy replies to the prompts of bench/speculative.py: at every step of
every reply, the longest suffix match and its voted continuation (``NgramDrafter.propose``'s
work), timed with the plain-Python vote decodert uses and with the numpy vote it keeps for many
occurrences; the drafts of the two are checked equal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=8)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from speculative import workloads

    from decodert.runtime.speculation.drafters import _voted_numpy, suffix_matches, voted_continuation
    from decodert.runtime.llm import LLM

    llm = LLM.load(args.artifact, backend="ort")
    for name, prompts in workloads(args.artifact).items():
        rows = [(np.array(q + llm.generate(q, max_new_tokens=args.gen, temperature=0.0).token_ids, np.int64), len(q))
                for q in prompts]
        steps = [h[:n] for h, start in rows for n in range(start, len(h))]
        figures = []
        for vote in (voted_continuation, _voted_numpy):
            t0, drafts = time.perf_counter(), []
            for hist in steps:
                starts, n = suffix_matches(hist, 4, 1)
                drafts.append(vote(hist, starts, args.draft_len).tolist() if n else [])
            figures.append((1e6 * (time.perf_counter() - t0) / len(steps), drafts))
        assert figures[0][1] == figures[1][1], "the two votes disagree"
        print(f"{name:<9} {len(steps)} row-steps: {figures[0][0]:.1f} us per row and step "
              f"(numpy vote: {figures[1][0]:.1f} us), same drafts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
