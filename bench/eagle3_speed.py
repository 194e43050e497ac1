"""End-to-end speed of an EAGLE-3 head (bench/train_eagle3.py's, or a published one converted by
``decodert export``) beside plain decoding and prompt lookup, on free-form prompts the head never saw.

    python bench/eagle3_speed.py --target out/smollm2-hs --head out/smollm2-eagle3
                                 [--gguf SmolLM2.gguf] [--head-folder ~/.cache/decodert-bench/smollm2-eagle3-head]
                                 [--modes plain,eagle3,eagle3-alone,ngram] [--prompt-set held-out|held-out-2] [--prompts N]
                                 [--repeats 3] [--gen 128] [--threads 2] [--json out.json]

``--target`` is a decodert artifact exported with ``--hidden-layers eagle3`` and ``--head`` the head artifact
(``decodert export HEAD_FOLDER --target-artifact TARGET -o HEAD``); with ``--gguf`` / ``--head-folder``
missing ones are exported first through the CLI. Every repeat runs every mode in a fresh worker process
(load, one untimed warm-up prompt that is not measured, then every held-out prompt of
bench/train_eagle3.py ``HELD_OUT``, or ``HELD_OUT_2`` (genres no training list has) with ``--prompt-set
held-out-2``, batch 1, greedy), rotating which mode goes first. Reported: decode
tok/s (tokens after the first / time after the first, summed over the prompts; the median over repeats),
the speed-up over plain, tokens per verify pass, and whether every reply's tokens equal plain decoding's
in every repeat (exit status 1 where they do not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("plain", "eagle3", "eagle3-alone", "ngram")  # eagle3-alone: the head without prompt lookup beside it
WARM_UP = "List four colours of the rainbow."


def log(msg: str) -> None:
    print(msg, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target artifact exported with --hidden-layers eagle3")
    p.add_argument("--head", type=Path, required=True, help="the EAGLE-3 head artifact")
    p.add_argument("--gguf", type=Path, default=None, help="export --target from this checkpoint when it is missing")
    p.add_argument("--head-folder", type=Path, default=None, help="export --head from this head folder when it is missing")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--prompt-set", choices=("held-out", "held-out-2"), default="held-out",
                   help="train_eagle3's HELD_OUT, or HELD_OUT_2 (genres in no training list)")
    p.add_argument("--prompts", type=int, default=None, help="the first N held-out prompts (default: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(MODES)}")
    if "plain" not in args.modes:
        p.error("--modes must include plain (the tokens and the speed-up are compared with it)")
    for name in ("repeats", "gen", "threads") + (("prompts",) if args.prompts is not None else ()):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for what, folder, source in (("--target", args.target, args.gguf), ("--head", args.head, args.head_folder)):
        if not (folder / "manifest.json" if what == "--target" else folder).exists() and source is None:
            p.error(f"{what} {folder} does not exist (export it first, or pass {'--gguf' if what == '--target' else '--head-folder'})")
        if source is not None and not source.exists():
            p.error(f"{'--gguf' if what == '--target' else '--head-folder'} {source} does not exist")
    return args


def export_missing(args: argparse.Namespace) -> None:
    """The target (with its hidden states) and the head, through ``decodert export``, where missing."""
    cmds = []
    if not (args.target / "manifest.json").is_file():
        cmds.append([str(args.gguf), "-o", str(args.target), "--hidden-layers", "eagle3"])
    if not args.head.exists():
        cmds.append([str(args.head_folder), "--target-artifact", str(args.target), "-o", str(args.head)])
    for cmd in cmds:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "decodert", "export", *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"decodert export {' '.join(cmd)}: {tail}")
        log(f"  exported {cmd[cmd.index('-o') + 1]} ({time.perf_counter() - t0:.0f} s)")


def run_worker(spec: dict) -> list[dict]:
    from decodert.runtime.llm import LLM

    mode = spec["mode"]
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    llm = LLM.load(spec["target"], backend="ort", draft=spec["head"] if mode.startswith("eagle3") else None)
    speculative = {"plain": None, "eagle3-alone": SpeculativeConfig("eagle3", prompt_lookup=False)}.get(mode, mode)
    chat = lambda text: llm.encode(llm.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)  # noqa: E731
    llm.generate(chat(WARM_UP), max_new_tokens=spec["gen"], temperature=0.0, speculative=speculative)
    out = []
    for prompt in spec["prompts"]:
        r = llm.generate(chat(prompt), max_new_tokens=spec["gen"], temperature=0.0, speculative=speculative)
        out.append({"tokens": list(map(int, r.token_ids)), "decode_s": r.metrics.total_s - r.metrics.ttft_s,
                    "accepted_per_step": r.metrics.accepted_per_step, "acceptance_rate": r.metrics.acceptance_rate})
    llm.close()
    return out


def in_worker(mode: str, prompts: list[str], args: argparse.Namespace) -> list[dict]:
    spec = {"mode": mode, "target": str(args.target), "head": str(args.head), "gen": args.gen, "prompts": prompts}
    env = {**os.environ, "DECODERT_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, __file__, "--target", "-", "--head", "-", "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{mode}: worker failed: {tail[:300]}")
    return json.loads(lines[-1])


def rate(rows: list[dict]) -> float:
    tokens = sum(max(len(r["tokens"]) - 1, 0) for r in rows)
    return tokens / max(sum(r["decode_s"] for r in rows), 1e-9)


def report(runs: dict[str, list[list[dict]]]) -> tuple[str, bool]:
    """The table, and whether every mode's tokens equal plain's in every repeat."""
    plain = runs.get("plain", [])
    base = statistics.median(rate(r) for r in plain) if plain else 0.0
    lines = [f"{'mode':8} {'tok/s':>7} {'x plain':>8} {'tok/pass':>9} {'accept':>7}  same tokens"]
    all_same = True
    for mode, reps in runs.items():
        if not reps:
            continue
        tps = statistics.median(rate(r) for r in reps)
        per = [x["accepted_per_step"] for rep in reps for x in rep if x.get("accepted_per_step") is not None]
        acc = [x["acceptance_rate"] for rep in reps for x in rep if x.get("acceptance_rate") is not None]
        same = all(a["tokens"] == b["tokens"] for rep in reps for p in plain for a, b in zip(rep, p))
        all_same = all_same and same
        lines.append(f"{mode:8} {tps:7.1f} {tps / base if base else 0:8.2f} {statistics.mean(per) if per else 1.0:9.2f} "
                     f"{statistics.mean(acc) if acc else 0.0:7.3f}  {'yes' if same else 'NO'}")
    return "\n".join(lines), all_same


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from train_eagle3 import HELD_OUT, HELD_OUT_2, train_prompts

    prompts = HELD_OUT if args.prompt_set == "held-out" else HELD_OUT_2
    assert not set(prompts) & set(train_prompts())
    export_missing(args)
    runs: dict[str, list[list[dict]]] = {m: [] for m in args.modes}
    for r in range(args.repeats):
        order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
        for mode in order:
            runs[mode].append(in_worker(mode, prompts[: args.prompts], args))
        log(f"  repeat {r + 1}/{args.repeats} done (load avg {os.getloadavg()[0]:.2f})")
    table, same = report(runs)
    log(table)
    if args.json:
        args.json.write_text(json.dumps(runs))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
