"""How far prompt lookup can go on bench/speculative.py's prompts, over a fixed cost table.

    python bench/ngram_ceiling.py ARTIFACT --costs 1:20.5,2:21.35,3:22.05,5:24.37,9:29.49 [--drafts 4] [--gen 128]

``--costs``: milliseconds of one target pass per width (1 = a decode step; other widths are
interpolated), e.g. from ``bench/verify_cost.py ARTIFACT --rows 1``. Makes decodert's plain greedy
reply to every prompt of each workload (grounded, free), then prints decode tok/s under the cost
table (tokens after the first / the summed cost of the passes) for:

- ``recent``: the most recent occurrence of the longest match, always ``--drafts`` tokens;
- ``voted``: decodert's drafter (the longest match's occurrences vote), always ``--drafts``;
- ``planner``: decodert's own speculative loop (adaptive width) run on the model, its step
  costs taken from the table instead of the clock, so timing noise does not move its choices;
- ``oracle choice``: the best continuation among every earlier match of any length (needs the
  reply: an upper bound for choosing among candidates), ``--drafts`` tokens;
- ``oracle trimmed``: the same, drafting only the tokens that will be accepted.

The simulated rows check each step's drafts against the plain reply's next tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import workloads  # noqa: E402


def cost_table(text: str) -> dict[int, float]:
    """"1:20.5,2:21.3,..." -> seconds per width 1..16, linear between the given widths."""
    given = dict(sorted((int(w), float(ms) / 1e3) for w, ms in (p.split(":") for p in text.split(","))))
    widths = list(given)
    return {w: float(np.interp(w, widths, [given[x] for x in widths])) for w in range(1, 17)}


def accepted(draft: list[int], future: list[int]) -> int:
    m = 0
    while m < len(draft) and m < len(future) and draft[m] == future[m]:
        m += 1
    return m


def all_matches(h: np.ndarray) -> list[int]:
    """Continuation starts of every earlier occurrence of the last token (any match length >= 1)."""
    return (np.flatnonzero(h[:-1] == h[-1]) + 1).tolist()


def simulate(policy: str, replies: list[tuple[list[int], list[int]]], cost: dict[int, float], k: int) -> float:
    from decodert.runtime.speculation.drafters import longest_suffix_match, suffix_matches, voted_continuation

    seconds = tokens = 0.0
    for prompt, out in replies:
        t = 1  # the first token comes from prefill
        while t < len(out):
            h, future = np.array(prompt + out[:t], np.int64), out[t:]
            room = min(k, len(future) - 1)
            draft: list[int] = []
            if room > 0 and policy == "recent":
                start, _ = longest_suffix_match(h, 4, 1)
                draft = [int(x) for x in h[start : start + room]] if start >= 0 else []
            elif room > 0 and policy == "voted":
                starts, n = suffix_matches(h, 4, 1)
                draft = [int(x) for x in voted_continuation(h, starts, room)] if n else []
            elif room > 0:  # oracles: the candidate that will be accepted longest
                draft = max(([int(x) for x in h[s : s + room]] for s in all_matches(h)),
                            key=lambda d: accepted(d, future), default=[])
                if policy == "oracle trimmed":
                    draft = draft[: accepted(draft, future)]
            m = accepted(draft, future)
            seconds += cost[len(draft) + 1]
            t += min(m + 1, len(future))
        tokens += len(out) - 1
    return tokens / seconds


def planner(llm, prompts: list[list[int]], cost: dict[int, float], gen: int) -> float:
    """decodert's speculative loop with the cost table as its step costs; tok/s under the table."""
    from decodert.runtime.speculation.planner import StepCosts

    class Table(StepCosts):
        def record(self, rows: int, width: int, seconds: float) -> None:
            pass

        def estimate(self, rows: int, width: int) -> float | None:
            return cost[width]

    llm.speculator.costs = Table()
    widths: list[int] = []
    be = llm.backend
    verify, decode = be.verify, be.decode
    be.verify = lambda cache, slots, ids, want_logits: (widths.append(max(len(x) for x in ids)),
                                                         verify(cache, slots, ids, want_logits))[1]
    be.decode = lambda cache, slots, ids, want_logits: (widths.append(1), decode(cache, slots, ids, want_logits))[1]
    tokens = 0
    try:
        for p in prompts:
            tokens += len(llm.generate(p, max_new_tokens=gen, temperature=0.0, speculative="ngram").token_ids) - 1
    finally:
        be.verify, be.decode = verify, decode
    return tokens / sum(cost[w] for w in widths)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--costs", required=True, type=cost_table, help="WIDTH:MS,... (1 = a decode step)")
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--gen", type=int, default=128)
    args = p.parse_args(argv)
    from decodert.runtime.llm import LLM

    llm = LLM.load(args.artifact, backend="ort")
    for name, prompts in workloads(args.artifact).items():
        replies = [(q, llm.generate(q, max_new_tokens=args.gen, temperature=0.0).token_ids) for q in prompts]
        rates = {policy: simulate(policy, replies, args.costs, args.drafts)
                 for policy in ("recent", "voted", "oracle choice", "oracle trimmed")}
        rates["planner"] = planner(llm, prompts, args.costs, args.gen)
        plain = 1.0 / args.costs[1]
        print(f"{name}: plain {plain:.1f} tok/s  " + "  ".join(f"{k} {v:.1f}" for k, v in rates.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
