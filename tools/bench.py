"""``decodert bench OUT``: prefill and decode speed of an artifact, with the hardware numbers.

Drives the backend directly (no tokenizer, no EOS): each run prefills ``--prompt-len`` fixed
pseudo-random token ids per row and decodes greedily until ``--gen`` tokens per row exist, so
every run does the same work. After ``--warmup`` untimed runs, ``--repeats`` timed runs give the
median and the min-max of

    ttft_ms      prefill call (prompt -> first token)
    prompt_tps   prompt tokens (all rows) / prefill time
    decode_tps   generated tokens after the first (all rows) / decode time
    tpot_ms      mean time of one decode step
    gbps         weight bytes read per decode step / step time (the achieved bandwidth)

``--speculative ngram|draft`` runs every row through ``LLM.generate`` with that speculation
instead (greedy, EOS ignored, the same ids), and adds ``accepted_per_step`` (tokens committed per
target pass) and ``acceptance_rate`` (drafts accepted / drafted); step_ms is then the mean step
(a pass commits several tokens) and ttft the slowest row's.

Bytes per step are the weights the decode graph reads: every initializer in full, except tables
only read by Gather (the embedding when the output projection is a separate or quantized copy,
the RoPE tables, the scales GatherBlockQuantized uses), which read one row per token. ``read_gbps`` is a measured memory
read (numpy sum of 256 MiB split over all cores; ``copy_gbps`` the same for a copy, bytes read + bytes
written), and ``floor_tps`` = read_gbps / bytes per step is the decode speed a memory-bound batch-1
step would reach if it only streamed its weights at that bandwidth.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.artifact.manifest import Manifest
from decodert.artifact.records import to_json
from decodert.runtime.decoding.metrics import peak_rss_mb
from decodert.tools.bandwidth import bytes_per_step, memcopy_gbps, memread_gbps


@dataclass
class Spread:
    """Median and range of one measure over the repeats."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)))

    def fmt(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


@dataclass
class RunTiming:
    """One run: the prefill call and every decode step, in seconds."""

    prefill_s: float
    step_s: np.ndarray  # [gen - 1]


@dataclass
class BatchResult:
    batch: int
    ttft_ms: Spread
    prompt_tps: Spread
    decode_tps: Spread  # all rows together
    tpot_ms: Spread  # one decode step (all rows)
    gbps: Spread  # weight bytes per step / step time
    step_ms: list[float]  # median time of the decode step at each context position (prompt_len + 1 ...)
    accepted_per_step: float = 0.0  # --speculative: tokens committed per target pass (mean over rows)
    acceptance_rate: float = 0.0  # --speculative: drafts accepted / drafts verified


@dataclass
class BenchResult:
    artifact: str
    model: str
    dtype: str
    quant: dict | None
    backend: str
    threads: int | None
    prompt_len: int
    gen: int
    warmup: int
    repeats: int
    weights_file_bytes: int  # weights.bin as written
    bytes_per_step: int  # weights a batch-1 decode step reads
    copy_gbps: float  # measured memory copy bandwidth (read + write)
    read_gbps: float  # measured memory read bandwidth
    floor_tps: float  # read_gbps / bytes_per_step: memory-bound batch-1 decode speed
    peak_rss_mb: float
    load_s: float
    machine: dict = field(default_factory=dict)
    results: list[BatchResult] = field(default_factory=list)
    speculative: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        return format_table(self)


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> np.ndarray:
    """Fixed pseudo-random prompt ids [length] int64 (the same for every runtime that is compared)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab_size, 32000), size=length).astype(np.int64)


class BackendRunner:
    """Runs one greedy request of ``batch`` rows straight on a decodert backend."""

    def __init__(self, backend: Any, batch: int) -> None:
        self.backend, self.batch = backend, batch
        self.cache = backend.allocate(batch)

    def run(self, ids: np.ndarray, gen: int) -> RunTiming:
        be, cache, slots = self.backend, self.cache, list(range(self.batch))
        cache.reset()
        clock = time.perf_counter
        t0 = clock()
        tokens = be.prefill(cache, slots, [ids] * self.batch, want_logits=False).next_token
        prefill_s = clock() - t0
        steps = np.empty(gen - 1)
        for i in range(gen - 1):
            t0 = clock()
            tokens = be.decode(cache, slots, tokens, want_logits=False).next_token
            steps[i] = clock() - t0
        return RunTiming(prefill_s, steps)


class SpeculativeRunner:
    """Runs ``batch`` rows through ``LLM.generate`` with ``speculative`` (EOS ignored: same work)."""

    def __init__(self, llm: Any, batch: int, speculative: Any) -> None:
        self.llm, self.batch, self.speculative = llm, batch, speculative
        llm.eos_token_ids = ()
        self.stats: list[tuple[float, float]] = []

    def run(self, ids: np.ndarray, gen: int) -> RunTiming:
        t0 = time.perf_counter()
        rs = self.llm.generate([ids] * self.batch, max_new_tokens=gen, temperature=0.0, speculative=self.speculative)
        wall = time.perf_counter() - t0
        prefill_s = max(r.metrics.ttft_s for r in rs)
        self.stats.append((statistics.mean(r.metrics.accepted_per_step for r in rs),
                           statistics.mean(r.metrics.acceptance_rate for r in rs)))
        return RunTiming(prefill_s, np.full(gen - 1, (wall - prefill_s) / max(gen - 1, 1)))


def summarize(batch: int, prompt_len: int, runs: Sequence[RunTiming], step_bytes: int) -> BatchResult:
    """Medians and ranges over the runs of one batch size."""
    decode_s = [float(r.step_s.sum()) for r in runs]
    n_steps = len(runs[0].step_s)
    per_pos = np.median(np.stack([r.step_s for r in runs]), axis=0) if n_steps else np.empty(0)
    safe = [max(s, 1e-12) for s in decode_s]
    return BatchResult(
        batch=batch,
        ttft_ms=Spread.of([1e3 * r.prefill_s for r in runs]),
        prompt_tps=Spread.of([batch * prompt_len / r.prefill_s for r in runs]),
        decode_tps=Spread.of([batch * n_steps / s for s in safe]),
        tpot_ms=Spread.of([1e3 * s / max(n_steps, 1) for s in decode_s]),
        gbps=Spread.of([step_bytes * n_steps / s / 1e9 for s in safe]),
        step_ms=[round(1e3 * float(x), 4) for x in per_pos],
    )


def time_runs(run: Callable[[], RunTiming], warmup: int, repeats: int,
              tick: Callable[[], None] = lambda: None) -> list[RunTiming]:
    """``warmup`` untimed runs, then ``repeats`` timed ones; ``tick()`` after each (progress)."""
    for _ in range(warmup):
        run()
        tick()
    timed = []
    for _ in range(repeats):
        timed.append(run())
        tick()
    return timed


def _placed(backend: Any) -> str:
    """`` (prefill=openvino decode=ort (measured))`` where phases were placed (runtime/backends/placement.py)."""
    placed = getattr(backend, "placement", None)
    return f" ({placed.describe()})" if placed is not None and placed.source in ("explicit", "measured", "cached") else ""


# ---- the command -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    prompt_len: int = 128
    gen: int = 128
    batches: tuple[int, ...] = (1,)
    repeats: int = 5
    warmup: int = 1
    threads: int | None = None
    backend: str = "auto"
    placement: Any = "auto"  # which backend runs each phase (runtime/backends/placement.py)
    speculative: str | None = None  # "ngram" | "draft": through LLM.generate (see the module docstring)
    draft: str | None = None  # the draft model's artifact for speculative="draft"
    draft_len: int | None = None  # most tokens drafted per step (None: SpeculativeConfig's default)


def bench(artifact_dir: str | Path, cfg: BenchConfig = BenchConfig(), progress: bool = True) -> BenchResult:
    """Load the artifact, check the arguments against it, time every batch size.

    ``progress``: runs done on stderr (export/progress.py: a bar on a terminal, else a line every 10 s)."""
    from decodert.export.progress import Stage
    from decodert.runtime.backends.loading import open_backend, read_manifest

    folder = Path(artifact_dir)
    manifest = read_manifest(folder)
    check_config(cfg, manifest)
    if cfg.threads:
        os.environ["DECODERT_THREADS"] = str(cfg.threads)  # read by the ORT backend's session options
    t0 = time.perf_counter()
    llm = None
    if cfg.speculative:
        from decodert.runtime.llm import LLM

        llm = LLM.load(folder, backend=cfg.backend, draft=cfg.draft, placement=cfg.placement)
        backend = llm.backend
    else:
        backend = open_backend(folder, manifest, cfg.backend, cfg.placement)
    load_s = time.perf_counter() - t0
    step_bytes = bytes_per_step(folder, manifest)
    ids = prompt_ids(manifest.model.vocab_size, cfg.prompt_len)
    results = []
    total = len(cfg.batches) * (cfg.warmup + cfg.repeats) + 1  # + the bandwidth measurement
    with Stage(f"bench {folder.name} (batch {','.join(map(str, cfg.batches))})", total=total, unit="run",
               enabled=progress) as bar:
        for batch in cfg.batches:
            runner = SpeculativeRunner(llm, batch, _speculation(cfg)) if llm is not None else BackendRunner(backend, batch)
            runs = time_runs(lambda: runner.run(ids, cfg.gen), cfg.warmup, cfg.repeats, bar.update)
            results.append(summarize(batch, cfg.prompt_len, runs, step_bytes))
            if llm is not None:
                results[-1].accepted_per_step, results[-1].acceptance_rate = runner.stats[-1]
        rss = peak_rss_mb()  # before the bandwidth tests, whose 0.5 GiB of buffers would count as peak
        copy, read = memcopy_gbps(), memread_gbps()
        bar.update()
    close = getattr(backend, "close", None)
    if close is not None:
        close()
    return BenchResult(
        artifact=str(folder), model=_model_name(manifest), dtype=manifest.dtype, quant=to_json(manifest.quant),
        backend=backend.name + _placed(backend), threads=cfg.threads, prompt_len=cfg.prompt_len, gen=cfg.gen, warmup=cfg.warmup,
        repeats=cfg.repeats, weights_file_bytes=int(manifest.weights.bytes or 0), bytes_per_step=step_bytes,
        copy_gbps=copy, read_gbps=read, floor_tps=read * 1e9 / step_bytes if step_bytes else 0.0,
        peak_rss_mb=rss,
        load_s=load_s, machine=machine_info(), results=results, speculative=cfg.speculative)


def _speculation(cfg: BenchConfig) -> Any:
    """``speculative=`` for LLM.generate: the method, or a SpeculativeConfig with --draft-len."""
    if cfg.draft_len is None:
        return cfg.speculative
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    return SpeculativeConfig(method=cfg.speculative or "ngram", draft_len=cfg.draft_len)


def check_config(cfg: BenchConfig, manifest: Manifest) -> None:
    """One-line errors for arguments the artifact cannot run."""
    max_batch, max_seq = manifest.max_batch, manifest.max_seq
    for name, value, low in (("--prompt-len", cfg.prompt_len, 1), ("--gen", cfg.gen, 1),
                             ("--repeats", cfg.repeats, 1), ("--warmup", cfg.warmup, 0)):
        if value < low:
            raise DecodertError(f"{name} must be >= {low} (got {value})")
    if not cfg.batches or min(cfg.batches) < 1:
        raise DecodertError(f"--batch sizes must be >= 1 (got {','.join(map(str, cfg.batches))})")
    if max(cfg.batches) > max_batch:
        raise DecodertError(f"--batch {max(cfg.batches)} exceeds the artifact's --max-batch {max_batch}")
    if cfg.prompt_len + cfg.gen > max_seq:
        raise DecodertError(f"--prompt-len {cfg.prompt_len} + --gen {cfg.gen} = {cfg.prompt_len + cfg.gen} "
                            f"exceeds the artifact's --max-seq {max_seq}")
    if cfg.threads is not None and cfg.threads < 1:
        raise DecodertError(f"--threads must be >= 1 (got {cfg.threads})")
    if cfg.speculative not in (None, "ngram", "draft"):
        raise DecodertError(f"--speculative must be ngram or draft (got {cfg.speculative})")
    if cfg.speculative == "draft" and not cfg.draft:
        raise DecodertError("--speculative draft needs --draft ARTIFACT (the draft model)")
    if cfg.draft and cfg.speculative != "draft":
        raise DecodertError("--draft is the draft model of --speculative draft; add --speculative draft")
    if cfg.draft_len is not None and (not cfg.speculative or cfg.draft_len < 1):
        raise DecodertError(f"--draft-len must be >= 1 (got {cfg.draft_len})" if cfg.speculative
                            else "--draft-len needs --speculative ngram|draft")


def machine_info() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "loadavg_1m": round(load[0], 2),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_name(manifest: Manifest) -> str:
    return Path((manifest.source.path if manifest.source else None) or "?").stem


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_table(r: BenchResult) -> str:
    quant = "" if not r.quant else f" int{r.quant['bits']} acc{r.quant['accuracy_level']}"
    lines = [f"{r.model} {r.dtype}{quant} ({r.backend}, threads {r.threads or 'default'}): prompt {r.prompt_len}, "
             f"gen {r.gen}, {_count(r.repeats, 'repeat')} after {r.warmup} warm-up; median (min-max)"
             + (f"; speculative {r.speculative}" if r.speculative else ""),
             f"{'batch':>5} {'ttft ms':>20} {'prompt tok/s':>22} {'decode tok/s':>20} {'tpot ms':>18} {'GB/s':>17}"
             + (f" {'tok/step':>8} {'accepted':>8}" if r.speculative else "")]
    for b in r.results:
        lines.append(f"{b.batch:>5} {b.ttft_ms.fmt():>20} {b.prompt_tps.fmt(0):>22} {b.decode_tps.fmt():>20} "
                     f"{b.tpot_ms.fmt(2):>18} {b.gbps.fmt(1):>17}"
                     + (f" {b.accepted_per_step:>8.2f} {b.acceptance_rate:>8.0%}" if r.speculative else ""))
    lines.append(f"weights read per step {r.bytes_per_step / 1e6:.1f} MB (file {r.weights_file_bytes / 1e6:.1f} MB) | "
                 f"memread {r.read_gbps:.1f} GB/s (copy {r.copy_gbps:.1f}) -> floor {r.floor_tps:.1f} tok/s at batch 1 | "
                 f"peak rss {r.peak_rss_mb:.0f} MB | load {r.load_s:.2f} s | load avg {r.machine.get('loadavg_1m')}")
    return "\n".join(lines)


def plot(r: BenchResult, path: str | Path) -> None:
    """Per-token decode time against context position, one line per batch size (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DecodertError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for b in r.results:
        positions = np.arange(len(b.step_ms)) + r.prompt_len + 1
        ax.plot(positions, b.step_ms, label=f"batch {b.batch}", linewidth=1)
    ax.set_xlabel("context position (tokens in the cache)")
    ax.set_ylabel("decode step (ms, median of repeats)")
    ax.set_title(f"{r.model} {r.dtype}{'' if not r.quant else ' int' + str(r.quant['bits'])}: decode time per token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
