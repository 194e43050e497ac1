"""Per-phase placement: which backend runs an artifact's prefill and its decode step, chosen by measurement.

The rule (docs/features/placement.md):

- The candidates of a phase are what is installed and what the artifact has a graph for: ``ort``
  (ONNX Runtime's CPU provider, MLAS kernels, over the target's graphs: always); for the prefill
  ``openvino-native`` (OpenVINO's own runtime over the ort prefill graph, runtime/backends/openvino/native.py:
  the new rows copied into the cache), ``openvino-sdpa`` (the same, its attention and fused projections
  lowered by runtime/backends/openvino/lowering.py) and ``openvino-paged`` (its attention as OpenVINO's
  PagedAttention, the held rows written into its blocks) where the ``openvino`` package is installed; and for both phases
  ``openvino`` (the OpenVINO execution provider, runtime/backends/openvino/ep.py, over the artifact's portable
  prefill graph: ``--openvino-prefill`` or a portable artifact, with ``onnxruntime-ep-openvino`` installed); and
  for the decode step ``native-cpu`` (decodert's own C step, runtime/backends/native/: dense llama-family int4,
  where a C compiler and AVX-512 VNNI are there: ``native_refusal``).
  All run over the same host cache buffers (runtime/backends/ort/backend.py ``place``).
- At first load each candidate of each phase is checked against ``ort`` on two prompts (``measure``: the
  greedy tokens of the prefill and ``PARITY_STEPS`` decode steps, teacher-forced, the same or a near tie
  within ``TIE`` logits), then timed at the artifact's shapes (prompts of ``SHORT`` and ``LONG`` tokens for
  prefill, decode steps after the short one), alternated, medians of ``REPEATS``. A candidate that cannot
  take the graph (it fails to open or to run) or fails parity is never chosen; the fastest of the others
  (the sum of its times relative to ort's) is kept per phase.
- The choice is cached in ``placement.json`` beside the artifact (or under ``$DECODERT_CACHE/placement/``
  when the folder is read-only), keyed by the CPU (model name, flags), the cores this process may use,
  ``$DECODERT_THREADS``, the library versions and the artifact's manifest; a changed key measures again.

Settings (``LLM.load(placement=...)``, ``--placement``): ``"auto"`` (the cached choice, else measure; where
``$DECODERT_PLACEMENT`` is set, what it says instead: ``off`` there makes every load today's single session),
``"measure"`` (measure again and cache), ``"off"`` / ``"ort"`` (today's single ort session, nothing
measured or written), or an explicit mapping like ``{"prefill": "openvino", "decode": "ort"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from decodert.errors import DecodertError, first_line
from decodert.artifact.manifest import MANIFEST, Manifest
from decodert.artifact.targets import target_info
from decodert.artifact.version import __version__

PHASES = ("prefill", "decode")
BACKENDS = ("ort", "openvino", "openvino-native", "openvino-sdpa", "openvino-paged", "native-cpu")
FILE = "placement.json"
SHORT, LONG = 128, 512  # prompt tokens of the two timed prefills (at most what the cache holds)
PARITY_STEPS = 8  # greedy decode steps after each parity prefill
REPEATS = 3  # timed runs per candidate and shape (the median is kept)


@dataclass(frozen=True)
class Placement:
    """Which backend runs each phase, and why (what ``inspect`` and the metrics line show)."""

    phases: Mapping[str, str]  # phase -> one of BACKENDS
    source: str  # "off" | "explicit" | "measured" | "cached" | "single" (one candidate: nothing to measure)
    figures: Mapping[str, Any] = field(default_factory=dict)  # phase -> {candidate: ms or refusal}
    file: str | None = None  # the cache file read or written

    def describe(self) -> str:
        """``prefill=openvino decode=ort (measured)``."""
        return " ".join(f"{p}={self.phases.get(p, 'ort')}" for p in PHASES) + f" ({self.source})"


OFF = Placement({p: "ort" for p in PHASES}, "off")


ENV = "DECODERT_PLACEMENT"  # what "auto" means on this machine: e.g. "off" never measures (CI, reproducible runs)


def parse(setting: Any) -> str | dict[str, str]:
    """A placement setting checked: "auto" | "measure" | "off" (None, "ort": off) or a phase -> backend mapping
    (a CLI string ``prefill=openvino,decode=ort`` too); DecodertError names what is wrong. "auto" is
    ``$DECODERT_PLACEMENT`` where that is set (any setting of this list; a bad one names the variable)."""
    if setting == "auto" and os.environ.get(ENV, "").strip() not in ("", "auto"):
        try:
            return parse(os.environ[ENV].strip())
        except DecodertError as e:
            raise DecodertError(f"${ENV}: {e}") from None
    if setting is None or setting == "ort":
        return "off"
    if isinstance(setting, str) and setting in ("auto", "measure", "off"):
        return setting
    if isinstance(setting, str) and "=" in setting:
        setting = dict(part.split("=", 1) for part in setting.split(",") if "=" in part)
    if not isinstance(setting, Mapping):
        raise DecodertError(f"placement must be auto, measure, off or a mapping like prefill=openvino,decode=ort; "
                            f"got {setting!r}")
    mapping = {str(k).strip(): str(v).strip() for k, v in setting.items()}
    bad = [f"{k}={v}" for k, v in mapping.items() if k not in PHASES or v not in BACKENDS]
    if bad or not mapping:
        raise DecodertError(f"placement {', '.join(bad) or '{}'}: phases are {', '.join(PHASES)}, "
                            f"backends {', '.join(BACKENDS)}")
    return mapping


def candidates(manifest: Manifest) -> dict[str, list[str]]:
    """phase -> the backends installed here that have a graph for it ("ort" first, always)."""
    from decodert.runtime.backends.openvino import ep, native

    prefill, decode = ["ort"], ["ort"]
    if openvino_refusal(manifest, "openvino-native") is None and native.available():
        prefill += ["openvino-native", "openvino-sdpa", "openvino-paged"]
    if openvino_refusal(manifest, "openvino") is None and ep.provider():
        prefill.append("openvino")
        decode.append("openvino")
    if native_refusal(manifest) is None:
        decode.append("native-cpu")
    return {"prefill": prefill, "decode": decode}


def native_refusal(manifest: Manifest) -> str | None:
    """Why the decode step of this artifact has no ``native-cpu`` candidate (decodert's own C step,
    runtime/backends/native/: dense llama-family int4 at accuracy level 4, on a CPU with AVX-512 VNNI and a C
    compiler); None: it has one (its decode graph is matched when the step opens: a mismatch is a refusal)."""
    from decodert.runtime.backends.native import step

    return step.refusal(manifest)


def openvino_refusal(manifest: Manifest, name: str = "openvino") -> str | None:
    """Why ``auto`` never places a phase of this artifact on ``name`` ("openvino": the EP over the portable prefill;
    "openvino-native": OpenVINO's runtime over the ort prefill); None: it may, after measuring."""
    info = target_info(manifest.target)
    if name == "openvino" and not (info.standard_ops or "prefill.portable" in (manifest.phase_graphs or {})):
        return "no portable prefill graph (export with --openvino-prefill)"
    if name in ("openvino-native", "openvino-sdpa", "openvino-paged") and not info.openvino_reads_prefill:
        return f"reads the ort target's prefill graph, not a --target {manifest.target} one"
    if manifest.dtype != "fp32" or (manifest.kv_dtype or manifest.dtype) != "fp32":
        return f"{manifest.dtype} activations / {manifest.kv_dtype} cache: only fp32 was checked on OpenVINO"
    if manifest.kv.states:  # the placement's parity and speed were checked on attention-only text models
        return "per-layer states (a hybrid model): not checked on OpenVINO"
    if manifest.model.images is not None:
        return "image inputs (a vision-language model): not checked on OpenVINO"
    if manifest.model.spec().experts() is not None:
        return "mixture-of-experts layers: not checked on OpenVINO"
    if manifest.lora_layout is not None:
        return "LoRA slots: the adapters' inputs run on the ort graphs only"
    if manifest.plugin_ops:
        return "decodert plugin nodes: OpenVINO reads no such op"
    return None


def open_placed(path: Path, manifest: Manifest, setting: Any, threads: int | None = None) -> Any:
    """The ort backend of ``path`` with each phase on the backend ``setting`` says (module docstring);
    ``backend.placement`` records it."""
    from decodert.runtime.backends.ort.backend import OrtBackend

    choice = parse(setting)
    if choice == "off":
        backend = OrtBackend(path, manifest, threads=threads)
        backend.placement = OFF
        return backend
    if isinstance(choice, dict):
        backend = OrtBackend(path, manifest, threads=threads, phases=choice)
        backend.drop_unplaced()
        backend.placement = Placement({**OFF.phases, **choice}, "explicit")
        return backend
    cands = candidates(manifest)
    if all(len(c) == 1 for c in cands.values()):
        backend = OrtBackend(path, manifest, threads=threads)
        backend.placement = Placement(OFF.phases, "single")
        _note_missing(manifest)
        return backend
    key = machine_key(path, threads)
    file = cache_file(path)
    cached = read_cached(file, key) if choice == "auto" else None
    if cached is not None:
        phases = {p: b for p, b in cached["phases"].items() if b != "ort"}
        try:
            backend = OrtBackend(path, manifest, threads=threads, phases=phases)
            backend.drop_unplaced()
            backend.placement = Placement({**OFF.phases, **cached["phases"]}, "cached", cached.get("figures", {}), str(file))
            return backend
        except DecodertError:
            pass  # the cached choice no longer opens here: measure again
    backend = OrtBackend(path, manifest, threads=threads)
    short = min(SHORT, backend.max_seq // 4)
    prompts = parity_prompts(path, manifest, short, min(LONG, backend.max_seq - PARITY_STEPS - 2))
    phases, figures = measure(backend, cands, prompts, threads)
    absent = native_refusal(manifest)
    if absent:  # why decodert's own decode step is not a candidate here (inspect shows it)
        figures["decode"].setdefault("native-cpu", {"absent": absent})
    for phase, name in phases.items():
        backend.place(phase, name)
    backend.drop_unplaced()
    written = write_cached(file, key, phases, figures)
    backend.placement = Placement(phases, "measured", figures, str(written) if written else None)
    return backend


_noted: list[bool] = []


def _note_missing(manifest: Manifest) -> None:
    """One info line per process where OpenVINO could run the artifact's prefill but is not installed."""
    if openvino_refusal(manifest, "openvino-native") is None and not _noted:
        _noted.append(True)
        print("decodert: info: OpenVINO is not installed, so the prefill runs on ONNX Runtime's CPU provider "
              "(pip install 'decodert[openvino]' for the faster one)", file=sys.stderr)


# ---- measurement ----------------------------------------------------------------------------------
# the parity prompts' text (a plain paragraph; repeated up to the long prompt's length)
TEXT = ("The river town kept its old stone bridge, and every morning the baker crossed it with a basket of bread "
        "for the school on the hill. The children counted the arches as they walked: seven, and a small one under "
        "the mill where the water ran fast. In spring the fields turned green, the market opened on Saturdays, and "
        "the teacher wrote the names of the months on the board, one after another, from January to December. ")
TIE = 0.5  # logits: a candidate may choose another token than ort only where ort scores it within this of its best


def parity_prompts(path: Path, manifest: Manifest, short: int, long: int) -> dict[str, np.ndarray]:
    """The short and the long parity prompt: ``TEXT`` in the artifact's tokenizer, repeated to length."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(path) / manifest.tokenizer.file)).encode(TEXT, add_special_tokens=False).ids
    ids = [i for i in ids if i < manifest.model.vocab_size] or [0]
    whole = np.array((ids * (long // len(ids) + 1))[:long], np.int64)
    return {"short": whole[:short], "long": whole}


def measure(backend: Any, cands: Mapping[str, list[str]], prompts: Mapping[str, np.ndarray],
            threads: int | None = None) -> tuple[dict[str, str], dict]:
    """Time and check each candidate of each phase on ``backend`` (its sessions, its cache buffers);
    returns (phase -> chosen backend, phase -> {candidate: {"short_ms", "long_ms"} | {"step_ms"} | {"refused"}}).

    Parity, teacher-forced: ort's greedy tokens of each prompt's prefill and ``PARITY_STEPS`` decode steps after
    it are fed to the candidate too (the other phase on ort); at every step the candidate's argmax must be
    ort's, or a token ort scores within ``TIE`` of its best (a near tie that int4 or bf16 rounding may flip)."""
    cache = backend.allocate(1)
    figures: dict[str, dict[str, Any]] = {p: {} for p in PHASES}
    usable: dict[str, list[str]] = {p: ["ort"] for p in PHASES}
    reference = {k: _steps(backend, cache, ids, None) for k, ids in prompts.items()}  # (tokens, logits) on ort
    for phase in PHASES:
        for name in [n for n in cands[phase] if n != "ort"]:
            try:
                backend.place(phase, name, threads)
                problem = None
                for key, ids in prompts.items():
                    tokens, ref_logits = reference[key]
                    chosen, _ = _steps(backend, cache, ids, tokens)
                    problem = problem or _parity_problem(key, tokens, chosen, ref_logits)
            except Exception as e:  # noqa: BLE001 - a candidate that fails on the graph, however it fails, is refused
                problem = f"{type(e).__name__}: {first_line(e)[:200]}"
            finally:
                cache.reset(0)
                backend.place(phase, "ort", threads)
            if problem:
                figures[phase][name] = {"refused": problem}
            else:
                usable[phase].append(name)
    # a phase with one usable candidate has nothing to choose: not timed (its figures say so)
    times: dict[str, dict[str, list[tuple]]] = {p: {n: [] for n in usable[p]} if len(usable[p]) > 1 else {} for p in PHASES}
    for _ in range(REPEATS):  # alternated: every candidate once per round
        for phase in PHASES:
            for name in times[phase]:
                backend.place(phase, name, threads)
                times[phase][name].append(_time_phase(backend, cache, phase, prompts))
            backend.place(phase, "ort", threads)
    chosen = {}
    for phase in PHASES:
        keys = ("short_ms", "long_ms") if phase == "prefill" else ("step_ms",)
        for name, samples in times[phase].items():
            figures[phase][name] = {k: round(1000 * statistics.median(s[i] for s in samples), 2) for i, k in enumerate(keys)}
        if not times[phase]:
            figures[phase].setdefault("ort", {"only": True})
            chosen[phase] = "ort"
            continue
        base = figures[phase]["ort"]
        chosen[phase] = min(usable[phase], key=lambda n: sum(figures[phase][n][k] / max(base[k], 1e-9) for k in keys))
    return chosen, figures


def _steps(backend: Any, cache: Any, ids: np.ndarray, forced: list[int] | None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and logits [1 + PARITY_STEPS, V] of a prefill of ``ids`` and the decode steps after it, each
    step fed ``forced``'s token where given (teacher forcing), else its own choice; slot 0, emptied after."""
    cache.reset(0)
    out = backend.prefill(cache, [0], [ids], True)
    tokens, logits = [int(out.next_token[0])], [out.logits[0].copy()]
    for i in range(PARITY_STEPS):
        fed = tokens[-1] if forced is None else forced[i]
        out = backend.decode(cache, [0], np.array([fed], np.int64), True)
        tokens.append(int(out.next_token[0]))
        logits.append(out.logits[0].copy())
    cache.reset(0)
    return tokens, np.stack(logits)


def _parity_problem(key: str, ref: list[int], got: list[int], ref_logits: np.ndarray) -> str | None:
    """Why ``got`` is not ort's choice ``ref`` within ``TIE`` (None: it is)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b and ref_logits[i, a] - ref_logits[i, b] > TIE:
            return (f"{key} prompt, step {i}: token {b} where ort chose {a}, which it scores "
                    f"{ref_logits[i, a] - ref_logits[i, b]:.2f} higher (tolerance {TIE})")
    return None


def _time_phase(backend: Any, cache: Any, phase: str, prompts: Mapping[str, np.ndarray]) -> tuple:
    """Seconds: (short prefill, long prefill) or (one decode step, the median of 4 after the short prompt)."""
    if phase == "prefill":
        out = []
        for key in ("short", "long"):
            cache.reset(0)
            t = time.perf_counter()
            backend.prefill(cache, [0], [prompts[key]], False)
            out.append(time.perf_counter() - t)
        cache.reset(0)
        return tuple(out)
    cache.reset(0)
    backend.prefill(cache, [0], [prompts["short"]], False)
    token, steps = np.array([11], np.int64), []
    for _ in range(5):
        t = time.perf_counter()
        backend.decode(cache, [0], token, False)
        steps.append(time.perf_counter() - t)
    cache.reset(0)
    return (statistics.median(steps[1:]),)


# ---- the cache file -----------------------------------------------------------------------------
def machine_key(path: Path, threads: int | None = None) -> dict[str, Any]:
    """What a measurement depends on: the CPU, the cores and threads, the libraries, the artifact."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import onnxruntime

    from decodert.runtime.backends.openvino import ep

    manifest = hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()[:16]
    return {"cpu": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16], "cores": cores,
            "threads": threads or int(os.environ.get("DECODERT_THREADS", "0") or 0),
            "openvino_config": os.environ.get("DECODERT_OPENVINO_CONFIG", ""),
            "onnxruntime": onnxruntime.__version__, "openvino_ep": ep.version(), "openvino": _dist_version("openvino"),
            "decodert": __version__, "manifest": manifest}


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cache_file(path: Path) -> Path:
    """``placement.json`` beside the artifact, or under ``$DECODERT_CACHE/placement/`` (default
    ~/.cache/decodert) named after the folder when the artifact folder is not writable."""
    path = Path(path).resolve()
    if os.access(path, os.W_OK):
        return path / FILE
    root = Path(os.environ.get("DECODERT_CACHE") or Path.home() / ".cache" / "decodert")
    return root / "placement" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.json"


def read_cached(file: Path, key: Mapping[str, Any]) -> dict | None:
    """The cached choice when its key is ``key`` (else None: measure again)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != dict(key) or not isinstance(data.get("phases"), dict):
        return None
    if any(data["phases"].get(p) not in BACKENDS for p in PHASES):
        return None
    return data


def write_cached(file: Path, key: Mapping[str, Any], phases: Mapping[str, str], figures: Mapping) -> Path | None:
    """Write the choice atomically; None where it cannot be written (the choice still holds for this process)."""
    data = {"key": dict(key), "phases": dict(phases), "figures": figures,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, file)
        return file
    except OSError:
        return None


def describe_artifact(path: Path) -> str | None:
    """What the cache file beside ``path`` says (``decodert inspect``), or None where there is none."""
    file = cache_file(path)
    try:
        data = json.loads(file.read_text())
        phases = data["phases"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fig = data.get("figures", {})
    parts = []
    for phase in PHASES:
        shown = ", ".join(f"{n} {_fig(v)}" for n, v in fig.get(phase, {}).items())
        parts.append(f"{phase}={phases.get(phase)}" + (f" [{shown}]" if shown else ""))
    return f"{'; '.join(parts)} (measured {data.get('measured', '?')}, {file})"


def _fig(v: Any) -> str:
    if not isinstance(v, dict):
        return str(v)
    if "refused" in v:
        return f"refused: {v['refused'][:80]}"
    if "absent" in v:
        return f"absent: {v['absent'][:80]}"
    if v.get("only"):
        return "the only candidate"
    return "/".join(f"{v[k]:g} ms" for k in ("short_ms", "long_ms", "step_ms") if k in v)
