"""Per-token cost of structured output: decode steps with and without llguidance masks.

    python bench/structured.py ART [ART ...] [--batch 1 4] [--steps 48] [--rounds 5]
    python bench/structured.py --from-gguf model.gguf --work /tmp/sb   # exports fp32 and int4 first

For each artifact and batch size, one round runs the real loop verbs (runtime/decoding/generate.py:
``prefill`` then ``decode_step``) over the same chat prompt in three ways and times every decode
step while all rows are still running:
  plain     greedy, unconstrained (eos ignored, so rows run the whole time): the graph-argmax path;
  auto      greedy, each row under its own JSON schema, the default rule (overlap only masks that
            took >= mask_overlap.OVERLAP_MIN_S);
  overlap   the same, masks always computed on the worker while the step runs;
  inline    the same with ``mask_overlap.OVERLAP = False`` (masks computed after the step).
The schemas force long outputs (minItems / minLength), so every row runs ``--steps`` steps.
Rounds alternate the four; the summary is the median over rounds of each round's median step.
``mask_ms`` / ``guide_ms``: the constraint work of one step for all rows alone, without the model
(``guide_cost``), robust to a noisy machine; ``guide_pct`` relates it to the plain step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMAS = [  # four different constraints, each long enough for the timed steps
    {"type": "object", "additionalProperties": False, "required": ["people"], "properties": {"people": {
        "type": "array", "minItems": 12, "maxItems": 12, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
                "name": {"type": "string", "minLength": 3, "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 20}}}}}},
    {"type": "array", "minItems": 24, "maxItems": 24, "items": {"type": "string", "minLength": 4, "maxLength": 30}},
    {"type": "object", "additionalProperties": False, "required": ["title", "story"], "properties": {
        "title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 300, "maxLength": 600}}},
    {"type": "object", "additionalProperties": False, "required": ["readings"], "properties": {"readings": {
        "type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "integer", "minimum": -500, "maximum": 500}}}},
]
_CACHE = None  # the benchmark's own KV cache, beside the LLM's engine
PROMPT = "Write JSON data about people, places and numbers."


def _sequences(llm, batch: int, constrained: bool, steps: int) -> list:
    from decodert.runtime.constraints import Constraint

    seqs = []
    for i in range(batch):
        c = Constraint.of(json_schema=SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        seq = llm.engine.sequence(llm.prepare([{"role": "user", "content": PROMPT}], chat=True, constraint=c,
                                              temperature=0, max_new_tokens=steps + 2))
        if not constrained:
            seq.stop_ids = frozenset()  # run the full length, like the constrained rows
        seqs.append(seq)
    return seqs


def time_steps(llm, batch: int, mode: str, steps: int) -> list[float]:
    """Seconds per decode step (all rows running) for one run in ``mode``: plain | auto | overlap | inline."""
    from decodert.runtime import mask_overlap
    from decodert.runtime.decoding.generate import decode_step, prefill

    seqs = _sequences(llm, batch, mode != "plain", steps)
    global _CACHE
    if _CACHE is None:  # one cache for every timed run (allocating per run would be timed too)
        _CACHE = llm.backend.allocate(int(llm.backend.max_batch))
    cache = _CACHE
    slots = list(range(batch))
    mask_overlap.OVERLAP = mode != "inline"
    default_min = mask_overlap.OVERLAP_MIN_S
    if mode == "overlap":
        mask_overlap.OVERLAP_MIN_S = 0.0
    try:
        prefill(llm.backend, cache, slots, seqs)
        out = []
        while not any(s.done for s in seqs) and len(out) < steps:
            t = time.perf_counter()
            decode_step(llm.backend, cache, slots, seqs)
            out.append(time.perf_counter() - t)
    finally:
        mask_overlap.OVERLAP, mask_overlap.OVERLAP_MIN_S = True, default_min
        cache.reset()
    if len(out) < steps:
        raise SystemExit(f"a row finished after {len(out)} of {steps} steps; lower --steps")
    return out


def guide_cost(llm, batch: int, steps: int) -> tuple[float, float]:
    """Median seconds per step of the constraint work alone for ``batch`` rows, replaying recorded
    tokens without the model: (masks only, masks + masking the logits + argmax + advance).

    The logits are random, so the graph's argmax is rarely allowed and every row takes the
    [V]-wide masking path: an upper bound of what the loop adds per step.
    """
    import numpy as np

    from decodert.runtime.constraints import Constraint
    from decodert.runtime.mask_overlap import compute_masks

    ids = llm.prepare([{"role": "user", "content": PROMPT}], chat=True).ids
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(batch)]
    traces = [llm.generate(ids, temperature=0, max_new_tokens=steps, json_schema=s).token_ids for s in schemas]
    if min(len(t) for t in traces) < steps:
        raise SystemExit(f"a schema's output is shorter than {steps} tokens; lower --steps")
    logits = np.random.default_rng(0).standard_normal((batch, llm.backend.vocab_size)).astype(np.float32)  # [n, V]
    out = {"mask": [], "all": []}
    for mode in out:
        guides = [llm.guidance.guide(Constraint.of(json_schema=s)) for s in schemas]
        for k in range(steps):
            t = time.perf_counter()
            compute_masks(guides)
            if mode == "all":
                for j, g in enumerate(guides):
                    int(np.argmax(g.mask_logits(logits[j])))
            out[mode].append(time.perf_counter() - t)
            for g, trace in zip(guides, traces):
                g.advance(trace[k])
        if mode == "all":  # advancing is part of the work too
            t = time.perf_counter()
            for g, trace in zip(guides, traces):
                g.rollback(steps)
                g.advance_many(trace[:steps])
            out["all"] = [x + (time.perf_counter() - t) / steps for x in out["all"]]
    return statistics.median(out["mask"]), statistics.median(out["all"])


def bench(artifact: str, batches: list[int], steps: int, rounds: int) -> list[dict]:
    from decodert.runtime.llm import LLM

    llm = LLM.load(artifact)
    quant = llm.manifest.quant.bits if llm.manifest.quant else None
    label = f"{Path(artifact).name} ({'int%d' % quant if quant else llm.manifest.dtype})"
    rows = []
    for batch in batches:
        time_steps(llm, batch, "auto", 4)  # warm-up (sessions, bindings, compiled schemas)
        per = {m: [] for m in ("plain", "auto", "overlap", "inline")}
        for _ in range(rounds):
            for mode in per:
                per[mode].append(statistics.median(time_steps(llm, batch, mode, steps)))
        med = {m: 1e3 * statistics.median(v) for m, v in per.items()}
        row = {"artifact": label, "batch": batch, **{f"{m}_ms": round(v, 3) for m, v in med.items()},
               **{f"{m}_pct": round(100 * (med[m] / med["plain"] - 1), 1) for m in ("auto", "overlap", "inline")},
               **{k: round(1e3 * v, 3) for k, v in zip(("mask_ms", "guide_ms"), guide_cost(llm, batch, steps))}}
        row["guide_pct"] = round(100 * row["guide_ms"] / med["plain"], 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    llm.close()
    return rows


def export_pair(gguf: str, work: Path) -> list[str]:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    out = []
    for name, quant in (("fp32", None), ("int4", QuantConfig(bits=4))):
        folder = work / name
        if not (folder / "manifest.json").is_file():
            export_model(gguf, folder, target="ort", dtype="fp32", max_seq=512, max_batch=4, progress=False, quant=quant)
        out.append(str(folder))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="*")
    p.add_argument("--from-gguf", help="export this GGUF as fp32 and int4 artifacts under --work first")
    p.add_argument("--work", default="/tmp/decodert-bench-structured")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    artifacts = list(args.artifacts) + (export_pair(args.from_gguf, Path(args.work)) if args.from_gguf else [])
    if not artifacts:
        p.error("give artifact folders or --from-gguf")
    print(f"# {args.steps} timed steps per run, {args.rounds} rounds; medians in ms; pct = vs plain", flush=True)
    for art in artifacts:
        bench(art, args.batch, args.steps, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
