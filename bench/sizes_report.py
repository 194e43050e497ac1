"""bench/sizes.py's summary: medians with spread, the bandwidth floor of each decode row, a table and a plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from decodert.tools.bench import Spread

DECODE_PROMPT = 128


def kv_bytes_per_token(shape: dict, runtime: str) -> int:
    """K and V of one token over all layers (fp32 caches; llama.cpp keeps f16)."""
    elem = 2 if runtime.startswith("llama") else 4
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * elem


def summarize(job: Any, shape: dict, runs: list[dict], read_gbps: float, gen: int) -> dict:
    """One row: TTFT, decode tok/s and TPOT (medians, min-max), peak RSS, floor and % of it."""
    batch = int(job.workload[6:]) if job.workload.startswith("decode") else 1
    row: dict[str, Any] = {"size": job.size, "runtime": job.runtime, "workload": job.workload, "runs": len(runs),
                           "load": statistics.median(r["load"] for r in runs),
                           "ttft_ms": Spread.of([1e3 * r["prefill_s"] for r in runs]).__dict__,
                           "rss_mb": max(r["rss_mb"] for r in runs), "weight_bytes": job.weight_bytes}
    if job.workload.startswith("decode"):
        steps = [sum(r["step_s"]) / len(r["step_s"]) for r in runs]
        row["tpot_ms"] = Spread.of([1e3 * s for s in steps]).__dict__
        row["tok_s"] = Spread.of([batch / s for s in steps]).__dict__
        context = DECODE_PROMPT + gen / 2  # mean tokens in the cache over the run
        step_bytes = job.weight_bytes + batch * context * kv_bytes_per_token(shape, job.runtime)
        row["floor_tok_s"] = batch * read_gbps * 1e9 / step_bytes
        row["floor_pct"] = 100 * row["tok_s"]["median"] / row["floor_tok_s"]
    return row


def _fmt(s: dict | None, digits: int = 1) -> str:
    return "-" if s is None else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(rows: list[dict]) -> str:
    head = (f"{'size':<13} {'runtime':<14} {'workload':<9} {'ttft ms':>24} {'tok/s':>18} {'tpot ms':>20} "
            f"{'floor':>6} {'%':>4} {'rss MB':>7} {'load':>5}")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["size"], r["workload"], r["runtime"])):
        floor = f"{r['floor_tok_s']:6.1f} {r['floor_pct']:4.0f}" if "floor_tok_s" in r else f"{'-':>6} {'-':>4}"
        lines.append(f"{r['size']:<13} {r['runtime']:<14} {r['workload']:<9} {_fmt(r['ttft_ms']):>24} "
                     f"{_fmt(r.get('tok_s')):>18} {_fmt(r.get('tpot_ms'), 2):>20} {floor} {r['rss_mb']:7.0f} "
                     f"{r['load']:5.2f}")
    lines += ["", "ratios (median; decode tok/s, or 1 / TTFT):"] + ratios(rows)
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """decodert against each other runtime at the same size and workload and comparable precision."""
    pairs = [("decodert-int4", "genai-int4"), ("decodert-int4", "ovgenai-int4"), ("decodert-int4", "llama-q4_0"),
             ("decodert-q4_0", "llama-q4_0"), ("decodert-fp32", "genai-fp32"), ("decodert-fp32", "ovgenai-fp32"),
             ("decodert-fp32", "llama-f16")]
    index = {(r["size"], r["workload"], r["runtime"]): r for r in rows}
    out = []
    for (size, workload, runtime), mine in sorted(index.items()):
        for a, b in pairs:
            other = index.get((size, workload, b))
            if runtime != a or other is None:
                continue
            if "tok_s" in mine:
                x = mine["tok_s"]["median"] / other["tok_s"]["median"]
            else:
                x = other["ttft_ms"]["median"] / mine["ttft_ms"]["median"]
            out.append(f"  {size} {workload}: {a} / {b} = x{x:.2f}")
    return out


def plot(rows: list[dict], path: Path) -> None:
    """One panel per (size, workload): a bar per runtime (decode tok/s or TTFT ms) with min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["size"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    for ax, (size, workload) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r["size"], r["workload"]) == (size, workload)), key=lambda r: r["runtime"])
        key = "tok_s" if workload.startswith("decode") else "ttft_ms"
        med = [r[key]["median"] for r in mine]
        err = [[m - r[key]["min"] for m, r in zip(med, mine)], [r[key]["max"] - m for m, r in zip(med, mine)]]
        colors = ["tab:blue" if r["runtime"].startswith("decodert") else "tab:gray" for r in mine]
        ax.bar(range(len(mine)), med, yerr=err, color=colors, capsize=3)
        ax.set_xticks(range(len(mine)), [r["runtime"] for r in mine], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{size}\n{workload} ({'tok/s' if key == 'tok_s' else 'TTFT ms'})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
