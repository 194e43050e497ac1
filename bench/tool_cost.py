"""Cost per decode step of tool-call and JSON constraints (issue 34's goal: at most +10% a step).

    python bench/tool_cost.py [MODEL] [--steps 48] [--rounds 3]     # MODEL: an artifact, "smollm2", a .gguf

For each mode one greedy chat reply of ``--steps`` tokens is generated (eos ignored: the constraint
forces long output), and the median decode step is compared with the unconstrained one:
  plain       no constraint (the graph-argmax path);
  json        response_format json_schema, strict (compact, closed objects);
  json_budget the same with max_tokens at the shortest completion + 8: the budget check (Guide.fit)
              runs a closing-path search on every step of the reply;
  tool_req    tool_choice "required" over two functions (Lark + %json, runtime/chat/tool_calls.py);
  tool_auto   tool_choice "auto": free text that may open a call (the TEXT | PRE call grammar).
``guide_ms`` replays each reply's tokens through a fresh guide without the model (mask + fit + advance
per token): the constraint's own work, robust to a noisy machine; ``guide_pct`` relates it to plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 30, "maxItems": 30, "items": {
    "type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 12},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"]}}}, "required": ["items"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LONG}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
MESSAGES = [{"role": "user", "content": "List thirty fruits with a number each, as JSON."}]


def modes(steps: int, need: int) -> dict[str, dict]:
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG}}
    return {"plain": {}, "json": {"response_format": fmt}, "json_budget": {"response_format": fmt, "budget": need + 8},
            "tool_req": {"tools": TOOLS, "tool_choice": "required"}, "tool_auto": {"tools": TOOLS, "tool_choice": "auto"}}


def run(llm, mode: dict, steps: int):
    """One reply -> (median decode step s, constraint work per token s)."""
    from decodert.runtime.constraints import Constraint
    from decodert.runtime.decoding.generate import decode_step, prefill

    params = dict(mode)
    budget = params.pop("budget", steps)
    fmt = params.pop("response_format", None)
    prepared = llm.prepare(MESSAGES, chat=True, constraint=Constraint.from_response_format(fmt), max_new_tokens=budget,
                           temperature=0.0, stop_token_ids=(), **params)
    seq = llm.engine.sequence(prepared)
    constraint = prepared.constraint
    seq.stop_ids = frozenset()  # run the whole budget
    cache = llm.backend.allocate(1)
    prefill(llm.backend, cache, [0], [seq])
    times = []
    while not seq.done and len(times) < steps:
        start = time.perf_counter()
        decode_step(llm.backend, cache, [0], [seq])
        times.append(time.perf_counter() - start)
    guide_s = replay(llm, constraint, seq.generated.tolist(), budget) if constraint is not None else 0.0
    return statistics.median(times), guide_s


def replay(llm, constraint, tokens: list[int], budget: int) -> float:
    guide = llm.guidance.guide(constraint)
    start = time.perf_counter()
    for i, t in enumerate(tokens):
        guide.compute_mask()
        guide.fit(t, budget - i)
        if guide.finished:
            break
        guide.advance(t)
    return (time.perf_counter() - start) / max(1, len(tokens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from decodert import LLM
    from decodert.runtime.constraints import Constraint

    llm = LLM.load(args.model)
    c = Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": LONG}})
    need = len(llm.guidance.closer.path(llm.guidance.compile(c), 100000))
    results: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, mode in modes(args.steps, need).items():
            results.setdefault(name, []).append(run(llm, mode, args.steps))
    plain = statistics.median(s for s, _ in results["plain"])
    print(f"model {args.model}  steps {args.steps}  rounds {args.rounds}  shortest JSON completion {need} tokens")
    print(f"{'mode':<12} {'step_ms':>8} {'vs_plain':>9} {'guide_ms':>9} {'guide_pct':>10}")
    for name, runs in results.items():
        step = statistics.median(s for s, _ in runs)
        guide = statistics.median(g for _, g in runs)
        print(f"{name:<12} {step * 1e3:8.2f} {100 * (step / plain - 1):+8.1f}% {guide * 1e3:9.3f} {100 * guide / plain:9.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
