"""How often a chat prompt gets the expected answer, per sampling setting, over seeds.

    python bench/first_answer.py ART [--prompt "What is the capital of France?"] [--expect Paris]
                                 [--seeds 20] [--max-new-tokens 24] [--settings "0.2/0.9,0.2/0.5"]

Each setting is ``temperature/top_p`` or ``temperature/top_p/repetition_penalty``; every seed
0..N-1 runs ``LLM.chat`` once, and the line printed counts the replies that contain ``--expect``,
plus the greedy reply. This is how docs/benchmarks/history.md ("First run") chose SmolLM2's defaults.
"""

from __future__ import annotations

import argparse


def setting(text: str) -> dict[str, float]:
    keys = ("temperature", "top_p", "repetition_penalty")
    values = [float(v) for v in text.split("/")]
    if not 2 <= len(values) <= 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected temperature/top_p[/repetition_penalty]")
    return dict(zip(keys, values))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--expect", default="Paris")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--settings", type=lambda s: [setting(x) for x in s.split(",")],
                   default=[setting("0.2/0.9"), setting("0.2/0.5")])
    args = p.parse_args(argv)
    from decodert.runtime.llm import LLM

    llm = LLM.load(args.artifact)
    msgs = [{"role": "user", "content": args.prompt}]
    greedy = llm.chat(msgs, temperature=0.0, max_new_tokens=args.max_new_tokens).text
    print(f"greedy: {greedy!r}")
    for kw in args.settings:
        hits = sum(args.expect in llm.chat(msgs, seed=s, max_new_tokens=args.max_new_tokens, **kw).text
                   for s in range(args.seeds))
        print(f"{kw}: {hits}/{args.seeds} replies contain {args.expect!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
