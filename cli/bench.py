"""``decodert bench OUT``: time prefill and greedy decode of an artifact (tools/bench.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from decodert.cli import common, inputs
from decodert.errors import DecodertError


def parse_batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4 (got {text!r})") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one batch size")
    return values


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``decodert bench OUT [--prompt-len N] [--gen N] [--batch 1,4] ...``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="time prefill and greedy decode of an artifact (tok/s, TPOT, GB/s, bandwidth floor)",
        description="Time prefill and greedy decode at each --batch size: --warmup untimed runs, then --repeats "
                    "timed ones; prints the median and range of TTFT, prompt and decode tok/s, TPOT and the weight "
                    "bytes read per second against this machine's memory bandwidth.")
    p.add_argument("out", metavar="MODEL", type=Path, help=common.MODEL_HELP + "; an artifact with engines "
                   "(`decodert build`) runs on them")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row (default 128)")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per row, the first included (default 128)")
    p.add_argument("--batch", type=parse_batches, default=(1,), help="batch sizes, e.g. 1,4 (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch size (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the runtime's own)")
    p.add_argument("--backend", choices=["auto", "ort", "trt"], default="auto", help="execution backend (default auto)")
    common.add_placement(p)
    common.add_speculative(p, help="time LLM.generate with this speculative decoding (ngram: prompt lookup; draft: "
                                   "--draft) and report tokens per target pass and the acceptance rate")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of decode time per token against context position")
    p.set_defaults(func=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> int:
    from decodert.tools.bench import BenchConfig, bench, plot

    spec = common.speculative_kwargs(args).get("speculative")  # one-line errors for bad combinations, before loading
    cfg = BenchConfig(prompt_len=args.prompt_len, gen=args.gen, batches=args.batch, repeats=args.repeats,
                      warmup=args.warmup, threads=args.threads, backend=args.backend, placement=args.placement,
                      speculative=spec.method if spec else None, draft=str(args.draft) if args.draft else None,
                      draft_len=args.draft_len)
    inputs.check_output_path(args.json, "--json")
    inputs.check_output_path(args.plot, "--plot")
    if args.plot is not None:
        _check_plot_possible()
    if cfg.draft:
        cfg = dataclasses.replace(cfg, draft=str(common.artifact_of(cfg.draft)))
    result = bench(common.artifact_of(args.out), cfg)
    print(result.table())
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if args.plot is not None:
        plot(result, args.plot)
    return 0


def _check_plot_possible() -> None:
    """Fail before a long run, not after it, when --plot cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise DecodertError("--plot needs matplotlib (pip install matplotlib)")
