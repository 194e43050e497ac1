"""Long fuzz run over decodert's readers: damaged GGUF, safetensors, manifest.json, ONNX, weights, engines.

    python scripts/fuzz.py                          # 2,000 hypothesis examples per target
    python scripts/fuzz.py --examples 20000 --targets gguf,safetensors --out /tmp/fuzz

The same mutators and targets as tests/project/test_fuzz.py (which runs a few dozen examples per target in
the default test run), from tests/helpers/fuzz_harness.py: each example damages one file of a small
pristine sample (truncation, bit flips, interesting integers, header-field and JSON-tree edits,
ONNX external-data locations) and runs the loader a user would hit, in a worker subprocess with a
time limit and an address-space limit. Every example must end "ok" (harmless damage) or "error"
(a one-line DecodertError); a crash, hang, MemoryError or other exception is a failure. Failing
inputs stay under --out (case folders named in report.json); exit code 1 if there was any.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from fuzz_harness import GOOD, PLANS, Fuzzer  # noqa: E402
from fuzz_samples import make_samples  # noqa: E402


class DataChooser:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


def fuzz_target(fuzzer: Fuzzer, target: str, examples: int, seed: int | None) -> tuple[Counter, list[dict]]:
    """Run ``examples`` hypothesis-generated cases of one target; count outcomes, keep the failures."""
    counts: Counter = Counter()
    failures: list[dict] = []

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data: st.DataObject) -> None:
        out = fuzzer.case(target, DataChooser(data))
        counts[out.status] += 1
        if out.status not in GOOD:
            failures.append({"status": out.status, "case": out.case, "message": out.message})
            print(f"  FAIL {out.report()[:300]}", flush=True)

    if seed is not None:
        run = hypothesis_seed(seed)(run)  # reproducible long runs
    run()
    return counts, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=2000, help="examples per target (default 2000)")
    p.add_argument("--targets", default=",".join(PLANS), help=f"comma-separated, from {','.join(PLANS)}")
    p.add_argument("--out", type=Path, default=None, help="folder for samples, failing cases and report.json")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="decodert-fuzz-"))
    fuzzer = Fuzzer(make_samples(out / "samples"), out / "cases", timeout=args.timeout)
    report = {}
    try:
        for target in args.targets.split(","):
            t0 = time.time()
            counts, failures = fuzz_target(fuzzer, target, args.examples, args.seed)
            report[target] = {"cases": sum(counts.values()), **counts, "seconds": round(time.time() - t0, 1),
                              "failures": failures}
            print(f"{target:12} {sum(counts.values()):6} cases  " + "  ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                  + f"  ({time.time() - t0:.0f} s)", flush=True)
    finally:
        fuzzer.close()
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"report: {out / 'report.json'}")
    return 1 if any(r["failures"] for r in report.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
