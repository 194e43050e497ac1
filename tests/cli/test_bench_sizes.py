"""bench/sizes.py on the ``tiny`` shape: checkpoint, GGUF, exports, workers, JSON and plot (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SIZES = Path(__file__).resolve().parents[2] / "bench" / "sizes.py"


def _sizes(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SIZES), *args], capture_output=True, text=True, timeout=600)


def test_sizes_suite_runs_on_a_tiny_shape(smollm2_gguf, tmp_path):
    out = tmp_path / "sizes.json"
    proc = _sizes("--sizes", "tiny", "--runtimes", "decodert-fp32,decodert-int4,decodert-q4_0",
                  "--workloads", "decode1,decode2,ttft16", "--repeats", "1", "--gen", "3", "--threads", "1", "--probe-mib", "64",
                  "--cache", str(tmp_path / "cache"), "--fixture", str(smollm2_gguf), "--json", str(out),
                  "--plot", str(tmp_path / "sizes.png"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["runtime"], r["workload"]) for r in rows} == {
        (rt, w) for rt in ("decodert-fp32", "decodert-int4", "decodert-q4_0") for w in ("decode1", "decode2", "ttft16")}
    decode = [r for r in rows if r["workload"].startswith("decode")]
    assert all(r["floor_tok_s"] > 0 and r["tok_s"]["min"] <= r["tok_s"]["median"] <= r["tok_s"]["max"] for r in decode)
    assert all(r["weight_bytes"] > 0 and r["rss_mb"] > 0 for r in rows)
    assert (tmp_path / "sizes.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "cache" / "tiny-Q4_0.gguf").is_file() and "ratios" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--workloads", "decode1,warp9"], "unknown workload 'warp9'"),
    (["--sizes", "llama-70b"], "unknown size llama-70b"),
    (["--runtimes", "vllm"], "unknown runtime vllm"),
    (["--repeats", "0"], "--repeats and --threads must be >= 1"),
])
def test_sizes_bad_arguments_exit_2(args, message, tmp_path):
    proc = _sizes(*args, "--cache", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"decodert: error: {message}")


def test_rotation_alternates_each_group_and_drops_a_failing_run():
    sys.path.insert(0, str(SIZES.parent))
    from rotation import rotate

    calls, lines = [], []

    def run(i: int) -> int:
        calls.append(i)
        if i == 3:
            raise RuntimeError("worker 3 failed")
        return i * 10

    got = rotate([[0, 1], [2, 3]], 2, run, lines.append)
    assert calls == [0, 1, 2, 3, 1, 0, 2]  # the first rotates per repeat; 3 failed once and is not run again
    assert got == {0: [0, 0], 1: [10, 10], 2: [20, 20]} and "  worker 3 failed" in lines
