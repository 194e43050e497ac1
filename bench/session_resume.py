"""Saved sessions and warm start (issue 48): what a resumed session and a warmed server save over a cold start.

    python bench/session_resume.py [--model smollm2] [--words 900] [--turns 6] [--rounds 3] [--json out.json]

(a) sessions: one worker builds a conversation (a system prompt of ``--words`` words, ``--turns`` short turns, greedy
    replies of 16 tokens), saves it (``Session.save``) and answers the next question (the reference). Then, each
    round in fresh processes, alternating: ``resume``: ``LLM.load`` + ``LLM.resume(file)`` + the next question;
    ``cold``: ``LLM.load`` (prefix cache off) + ``llm.chat(history + question)``, the whole history prefilled. Times:
    resume (file read, checks, K/V written into the row), the next turn's TTFT, and resume + TTFT against the cold
    TTFT; the answers are compared with the reference.
(b) warm start: ``warm``: ``LLM.load`` + ``llm.warm([system])`` + the first chat on that system prompt; ``nowarm``: the
    same first chat without it. TTFT of that first request and the warm-up's own time (what a server pays before
    it listens).
Every worker first runs one short unrelated prompt (ONNX Runtime's first run). Medians over the rounds; no figure is
asserted here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is this manual about?", "Who should read it?", "What comes first?", "And then?",
             "Is there a safety part?", "How long is it?", "Sum it up in one line.", "Thanks. Anything else?"]
NEXT = "Which section should a new operator read first, and why?"


def system_prompt(words: int) -> str:
    base = (ROOT / "bench" / "fixed_text.txt").read_text().split()
    out, k = [], 0
    while sum(len(p.split()) for p in out) < words:
        out.append(f"Section {k + 1}. " + " ".join(base[(k * 37) % len(base):] + base[: (k * 37) % len(base)])[:600])
        k += 1
    return "You are the assistant of this operations manual. Answer from it only.\n\n" + "\n\n".join(out)


def worker(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT.parent))
    from decodert import LLM

    t0 = time.perf_counter()
    llm = LLM.load(args.model, prefix_cache_mb=0 if args.worker in ("cold", "nowarm") else None)
    load_s = time.perf_counter() - t0
    llm.generate("Hello", max_new_tokens=2, temperature=0)  # ONNX Runtime's first run
    system = system_prompt(args.words)
    out: dict = {"load_s": load_s}
    if args.worker == "save":
        session = llm.session(system=system)
        for q in QUESTIONS[: args.turns]:
            session.chat(q, max_new_tokens=16, temperature=0)
        out["bytes"] = session.save(args.file)
        out["held"] = session.cached_tokens
        r = session.chat(NEXT, max_new_tokens=16, temperature=0)
        out.update(tokens=r.token_ids, history=session.history[:-2], prompt_tokens=r.metrics.prompt_tokens)
    elif args.worker == "resume":
        t = time.perf_counter()
        session = llm.resume(args.file)
        out["resume_s"] = time.perf_counter() - t
        r = session.chat(NEXT, max_new_tokens=16, temperature=0)
        out.update(ttft_s=r.metrics.ttft_s, cached=r.metrics.cached_tokens, tokens=r.token_ids)
    elif args.worker == "cold":
        history = json.loads(Path(args.file + ".history.json").read_text())
        r = llm.chat(history + [{"role": "user", "content": NEXT}], max_new_tokens=16, temperature=0)
        out.update(ttft_s=r.metrics.ttft_s, cached=r.metrics.cached_tokens, tokens=r.token_ids)
    else:  # warm | nowarm
        messages = [{"role": "system", "content": system}]
        if args.worker == "warm":
            t = time.perf_counter()
            out["warmed"] = llm.warm([messages])[0]
            out["warm_s"] = time.perf_counter() - t
        r = llm.chat(messages + [{"role": "user", "content": NEXT}], max_new_tokens=16, temperature=0)
        out.update(ttft_s=r.metrics.ttft_s, cached=r.metrics.cached_tokens, prompt_tokens=r.metrics.prompt_tokens,
                   tokens=r.token_ids)
    return out


def run(kind: str, args: argparse.Namespace, file: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--file", file, "--model", args.model, "--words", str(args.words),
           "--turns", str(args.turns)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--words", type=int, default=900)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        file = str(Path(tmp) / "bench.session")
        ref = run("save", args, file)
        Path(file + ".history.json").write_text(json.dumps(ref["history"]))
        rows: dict[str, list[dict]] = {k: [] for k in ("resume", "cold", "warm", "nowarm")}
        for _ in range(args.rounds):
            for kind in rows:
                rows[kind].append(run(kind, args, file))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    report = {
        "session": {"history_tokens": ref["held"], "file_bytes": ref["bytes"], "next_prompt_tokens": ref["prompt_tokens"],
                    "resume_s": med("resume", "resume_s"), "resume_ttft_s": med("resume", "ttft_s"),
                    "cold_ttft_s": med("cold", "ttft_s"), "resume_cached": med("resume", "cached"),
                    "same_tokens": all(r["tokens"] == ref["tokens"] for r in rows["resume"]),
                    "cold_same_tokens": all(r["tokens"] == ref["tokens"] for r in rows["cold"])},
        "warm": {"prompt_tokens": rows["warm"][0]["prompt_tokens"], "warmed_tokens": rows["warm"][0]["warmed"],
                 "warm_s": med("warm", "warm_s"), "first_ttft_s": med("warm", "ttft_s"),
                 "cold_first_ttft_s": med("nowarm", "ttft_s"), "cached": med("warm", "cached"),
                 "same_tokens": all(r["tokens"] == rows["nowarm"][0]["tokens"] for r in rows["warm"] + rows["nowarm"])},
        "rounds": args.rounds,
    }
    s, w = report["session"], report["warm"]
    print(f"session: {s['history_tokens']} tokens held, file {s['file_bytes'] / 2**20:.1f} MiB; resume {s['resume_s']*1000:.0f} ms"
          f" + next-turn TTFT {s['resume_ttft_s']*1000:.0f} ms vs cold re-prefill TTFT {s['cold_ttft_s']*1000:.0f} ms "
          f"({(s['resume_s'] + s['resume_ttft_s']) / s['cold_ttft_s']:.2f}x); same tokens: {s['same_tokens']}")
    print(f"warm start: {w['warmed_tokens']} of {w['prompt_tokens']} tokens warmed in {w['warm_s']*1000:.0f} ms; first request "
          f"TTFT {w['first_ttft_s']*1000:.0f} ms vs {w['cold_first_ttft_s']*1000:.0f} ms cold "
          f"({w['first_ttft_s'] / w['cold_first_ttft_s']:.2f}x, cached {w['cached']:.0f}); same tokens: {w['same_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
