"""decodert's own prefill graph under ONNX Runtime CPU, ONNX Runtime + the OpenVINO EP plugin and
OpenVINO's own runtime, with the settings each takes; prints TTFT per setting and its parity.

    python bench/ov_prefill.py ARTIFACT [ARTIFACT ...] [--lens 128,1024,4096] [--configs NAME,...]
                               [--repeats 3] [--threads 2] [--json ov_prefill.json] [--list]

1. For every artifact (``decodert export --target portable|ort``, fp32 or int4) and every setting of
   ``CONFIGS`` (``--list`` prints them: ``ort-cpu`` = decodert's own session options; ``ep-*`` = ONNX
   Runtime 1.32 with the ``onnxruntime-ep-openvino`` plugin and its provider options; ``ov-*`` =
   ``openvino.Core().read_model(prefill.onnx)`` compiled for "CPU" with a property dict; ``-static``
   ones reshape the graph to the prompt's length first), a fresh worker process loads the prefill
   graph, runs an untimed 16-token prompt (thread pools, buffers), then times one prompt of each
   ``--lens`` length (fixed pseudo-random ids, an empty cache): ``first`` is the first call at that
   length (what a request sees), with ``--again`` also the second (a warm shape). Settings alternate
   within every repeat with the first rotating; the table gives medians (min-max) over ``--repeats``.
   ``ort-cpu`` is timed on the first artifact only (today's path: give the ort target first) unless
   ``--time-refs``; on the others it is the parity reference. A setting that cannot run an
   artifact's graph as the contract says is skipped with the reason (the OpenVINO EP on the ort
   target; OpenVINO's runtime on the ort target without ``-rows``).
2. The cache is fed as the graph contract says (artifact/graph_contract.py): ``past_key.i`` /
   ``past_value.i`` [1, H_kv, max_seq, D] buffers bound as the same memory as ``present_*`` where
   the runtime allows it (ORT io_binding, OpenVINO ``set_tensor`` on shared numpy memory),
   ``past_lengths`` [0], ``seq_lengths`` [L].
3. Parity, per setting against ``ort-cpu`` on the same artifact (and against the first artifact's
   ``ort-cpu`` when given several, e.g. the ort target first): a ``--parity-len`` prompt of
   bench/fixed_text.txt prefilled by the setting, then ``--parity-gen`` steps of ONNX Runtime CPU's
   decode graph over the cache that prefill wrote, fed the text's own next tokens (teacher forcing):
   the per-phase placement this measures (prefill on one backend, decode on MLAS over the same cache).
   Printed: max |logit difference| at the prompt's last position and over every position, and on how
   many positions the argmax agrees.

4. ``--ovgenai FOLDER`` (an ``optimum-cli export openvino`` of the same model, bench/competitors.py)
   adds the peer's own TTFT at each length in the same rotation: OpenVINO GenAI in the ``--ov-venv``
   environment, a fresh worker per length (load, a 16-token warm-up of other ids, the same prompt ids).

Uses what is installed in this interpreter (onnxruntime, onnxruntime-ep-openvino, openvino); a
setting whose runtime is missing or refuses the graph is reported and dropped.
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
from typing import Any

import numpy as np

from install import DEFAULT_OV_VENV
from rotation import rotate

from decodert.tools import bench as B

THREADS = 2
# name -> (runtime, settings). ep: provider options of the OpenVINO EP (strings; load_config a dict of
# OpenVINO CPU properties, sent as JSON); ov: compile_model properties.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "ort-cpu": ("ort", {}),
    "ep-fp32": ("ep", {"precision": "FP32"}),  # runs bf16 where the CPU has it: the plugin's default hint
    "ep-f32": ("ep", {"precision": "FP32", "load_config": {"CPU": {"INFERENCE_PRECISION_HINT": "f32"}}}),
    "ep-accuracy": ("ep", {"precision": "ACCURACY"}),
    "ep-bf16": ("ep", {"precision": "FP32", "load_config": {"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}}}),
    "ep-bf16-latency": ("ep", {"precision": "FP32", "num_streams": "1", "load_config": {"CPU": {
        "INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"}}}),
    "ep-f32-dq32": ("ep", {"precision": "FP32", "load_config": {"CPU": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}}}),
    "ep-f32-nodq": ("ep", {"precision": "FP32", "load_config": {"CPU": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}}}),
    "ep-bf16-dq32": ("ep", {"precision": "FP32", "load_config": {"CPU": {
        "INFERENCE_PRECISION_HINT": "bf16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"}}}),
    "ep-qdq": ("ep", {"precision": "FP32", "enable_qdq_optimizer": "True"}),
    "ov-f32": ("ov", {"INFERENCE_PRECISION_HINT": "f32"}),
    "ov-default": ("ov", {}),  # the CPU plugin's own choice: bf16 where the CPU has AMX/avx512_bf16
    "ov-bf16": ("ov", {"INFERENCE_PRECISION_HINT": "bf16"}),
    "ov-bf16-latency": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}),
    "ov-f32-dq32": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32}),
    "ov-f32-nodq": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    "ov-bf16-nodq": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
    "ov-bf16-static": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "static": True}),
    "ov-f32-static": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "static": True}),
    # the ort target's GroupQueryAttention as OpenVINO reads it appends the new rows to the past it is given
    # (present = [past; new], not written in place): "rows" feeds the cache's first past_lengths rows and
    # copies the new ones back, the only way its cache comes out right
    "ov-bf16-rows": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "rows": True}),
    "ov-f32-rows": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "rows": True}),
    "ov-f32-nodq-rows": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "rows": True}),
    # the same, its GroupQueryAttention lowered to OpenVINO's SDPA by runtime/backends/openvino/lowering.py
    # (placement's openvino-sdpa) instead of the frontend's own translation (openvino-native)
    "ov-bf16-sdpa-rows": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "rows": True, "sdpa": True}),
    "ov-f32-sdpa-rows": ("ov", {"INFERENCE_PRECISION_HINT": "f32", "rows": True, "sdpa": True}),
    # compiled blobs kept in --work/ov-cache ("{cache}"): the load time of a later process
    "ep-bf16-cache": ("ep", {"precision": "FP32", "cache_dir": "{cache}",
                             "load_config": {"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}}}),
    "ov-bf16-cache": ("ov", {"INFERENCE_PRECISION_HINT": "bf16", "CACHE_DIR": "{cache}"}),
}
DEFAULT_CONFIGS = "ort-cpu,ep-fp32,ep-bf16,ov-f32,ov-bf16"


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- the graph's feeds -------------------------------------------------------------------------
def manifest(artifact: Path) -> dict[str, Any]:
    return json.loads((artifact / "manifest.json").read_text())


def cache_buffers(m: dict[str, Any]) -> dict[str, np.ndarray]:
    """past_key.i / past_value.i zero buffers [1, H_kv, max_seq, D] as graphs.prefill lists them."""
    bufs = {}
    for t in m["graphs"]["prefill"]["inputs"]:
        if t["name"].startswith(("past_key.", "past_value.")):
            shape = [1 if d == "batch" else int(d) for d in t["shape"]]
            bufs[t["name"]] = np.zeros(shape, {"fp32": np.float32, "fp16": np.float16}[t["dtype"]])
    return bufs


def small_feeds(ids: np.ndarray, past: int) -> dict[str, np.ndarray]:
    return {"input_ids": ids.reshape(1, -1).astype(np.int64), "past_lengths": np.array([past], np.int64),
            "seq_lengths": np.array([len(ids)], np.int64)}


class Prefill:
    """One setting's prefill over one cache (dict name -> buffer, updated in place by every call)."""

    def __init__(self, artifact: Path, config: str, threads: int, cache_dir: str = "") -> None:
        self.m = manifest(artifact)
        self.cache = cache_buffers(self.m)
        self.path = artifact / self.m["graphs"]["prefill"]["file"]
        runtime, settings = CONFIGS[config]
        self.runtime = runtime
        self.settings = {k: cache_dir if v == "{cache}" else v for k, v in settings.items()}
        self.static = bool(self.settings.pop("static", False))
        self.rows = bool(self.settings.pop("rows", False))
        sdpa = bool(self.settings.pop("sdpa", False))
        self.vocab = int(self.m["model"]["vocab_size"])
        self.compiled: dict[int, Any] = {}
        self.threads = threads
        if runtime in ("ort", "ep"):
            self.session = ort_session(self.path, runtime, self.settings, threads)
        else:
            import openvino as ov

            self.core = ov.Core()
            if sdpa:
                from decodert.runtime.backends.openvino.lowering import GqaToSdpa

                for extension in GqaToSdpa().extensions():
                    self.core.add_extension(extension)
            self.props = {"INFERENCE_NUM_THREADS": threads, **self.settings}
            self.model = self.core.read_model(str(self.path))
            if self.rows:  # the cache inputs take any length: the rows held so far
                self.model.reshape({n: ov.PartialShape([1, b.shape[1], -1, b.shape[3]]) for n, b in self.cache.items()})
            if not self.static:
                self.compiled[-1] = self.core.compile_model(self.model, "CPU", self.props)

    def reset(self) -> None:
        for b in self.cache.values():
            b[:] = 0

    def __call__(self, ids: np.ndarray, past: int = 0) -> np.ndarray:
        """Run the prefill of ``ids`` after ``past`` cached tokens; the last position's logits [vocab]."""
        feeds = small_feeds(ids, past)
        if self.runtime in ("ort", "ep"):
            return self._run_ort(feeds)
        return self._run_ov(feeds)

    def _run_ort(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        io = self.session.io_binding()
        for name, arr in feeds.items():
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        for name, arr in self.cache.items():
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            out = "present_" + name[len("past_"):]
            io.bind_output(out, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        logits = np.empty((1, self.vocab), np.float32)
        io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return logits[0]

    def _run_ov(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        import openvino as ov

        key = feeds["input_ids"].shape[1] if self.static else -1
        if key not in self.compiled:
            model = self.model.clone()
            model.reshape({"input_ids": [1, key], "past_lengths": [1], "seq_lengths": [1],
                           **{n: list(b.shape) for n, b in self.cache.items()}})
            self.compiled[key] = self.core.compile_model(model, "CPU", self.props)
        compiled = self.compiled[key]
        req = getattr(self, "_req_" + str(key), None) or compiled.create_infer_request()
        setattr(self, "_req_" + str(key), req)
        for name, arr in feeds.items():
            req.set_tensor(name, ov.Tensor(arr, shared_memory=True))
        past, n = int(feeds["past_lengths"][0]), feeds["input_ids"].shape[1]
        for name, arr in self.cache.items():
            if self.rows:  # the rows held so far [1, H, past, D] in, [1, H, past + n, D] out
                req.set_tensor(name, ov.Tensor(np.ascontiguousarray(arr[:, :, :past])))
            else:  # present_* written into the same buffers
                req.set_tensor(name, ov.Tensor(arr, shared_memory=True))
                req.set_tensor(compiled.output("present_" + name[len("past_"):]), ov.Tensor(arr, shared_memory=True))
        req.infer()
        if self.rows:
            for name, arr in self.cache.items():
                arr[:, :, past:past + n] = req.get_tensor("present_" + name[len("past_"):]).data[:, :, past:past + n]
        return np.array(req.get_tensor("logits").data[0])


def ort_session(path: Path, runtime: str, settings: dict[str, Any], threads: int) -> Any:
    import onnxruntime as ort

    from decodert.runtime.backends.ort_session import open_session, session_options

    so = session_options(threads)
    if runtime == "ort":
        return open_session(path, so, ["CPUExecutionProvider"])
    import onnxruntime_ep_openvino as plugin

    name = plugin.get_ep_name()
    if not any(d.ep_name == name for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(name, plugin.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    opts = {"num_of_threads": str(threads), **{k: (json.dumps(v) if isinstance(v, dict) else str(v))
                                                for k, v in settings.items()}}
    so.add_provider_for_devices(devices, opts)
    return ort.InferenceSession(str(path), so)


# ---- parity: this prefill, then ONNX Runtime CPU's decode over the same cache -------------------
def teacher_forced(pre: Prefill, artifact: Path, ids: np.ndarray, follow: np.ndarray, threads: int) -> np.ndarray:
    """Logits [1 + len(follow), vocab]: the prompt's last position from ``pre``, then one ORT CPU decode step
    per token of ``follow`` (the text's own continuation, fed whatever was predicted) over the cache ``pre``
    wrote. Position-wise argmax agreement then measures the prefill's effect without one flipped near-tie
    sending the rest of a greedy run elsewhere."""
    pre.reset()
    rows = [pre(ids)]
    dec = ort_session(artifact / pre.m["graphs"]["decode"]["file"], "ort", {}, threads)
    out = np.empty((1, pre.vocab), np.float32)
    for i, token in enumerate(follow):
        io = dec.io_binding()
        feeds = small_feeds(np.array([token]), len(ids) + i)
        for name, arr in {**feeds, **pre.cache}.items():
            io.bind_input(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        for name, arr in pre.cache.items():
            io.bind_output("present_" + name[len("past_"):], "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        io.bind_output("logits", "cpu", 0, out.dtype, out.shape, out.ctypes.data)
        dec.run_with_iobinding(io)
        rows.append(out[0].copy())
    return np.stack(rows)


# ---- worker ------------------------------------------------------------------------------------
def worker(spec: str) -> int:
    job = json.loads(spec)
    artifact = Path(job["artifact"])
    t0 = time.perf_counter()
    pre = Prefill(artifact, job["config"], job["threads"], job["cache_dir"])
    load_s = time.perf_counter() - t0
    pre(B.prompt_ids(pre.vocab, 16, seed=1))  # warm-up: pools, buffers
    result: dict[str, Any] = {"load_s": load_s, "first": {}, "again": {}}
    for n in job["lens"]:
        for which in ("first", "again") if job["again"] else ("first",):
            pre.reset()
            ids = B.prompt_ids(pre.vocab, n)
            t0 = time.perf_counter()
            pre(ids)
            result[which][str(n)] = time.perf_counter() - t0
    if job["parity"]:
        text = parity_text(artifact, pre.vocab, job["parity_len"] + job["parity_gen"])
        logits = teacher_forced(pre, artifact, text[: job["parity_len"]], text[job["parity_len"]:], job["threads"])
        np.save(job["parity"], logits)
        result["tokens"] = logits.argmax(-1).tolist()
    print(json.dumps(result))
    return 0


def parity_text(artifact: Path, vocab: int, n: int) -> np.ndarray:
    """``n`` ids of bench/fixed_text.txt through the artifact's tokenizer (random ids if it has none)."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        text = (Path(__file__).parent / "fixed_text.txt").read_text()
        ids = np.array(tok.encode(text * 8).ids[:n], np.int64)
        if len(ids) == n and ids.max() < vocab:
            return ids
    except Exception:  # no tokenizer.json: a random-weight shape, whose tokens mean nothing anyway
        pass
    return B.prompt_ids(vocab, n, seed=2)


def skipped(artifact: Path, config: str) -> str | None:
    """Why ``config`` cannot run ``artifact``'s prefill as the contract says (None: it can)."""
    runtime, settings = CONFIGS[config]
    target = manifest(artifact)["target"]
    if runtime == "ep" and target != "portable":
        return "the OpenVINO EP fails on the ort target's contrib ops (EP_FAIL: input names mismatch)"
    if runtime == "ep":
        from decodert.runtime.backends.openvino import ep

        if ep.provider() is None:
            return "the OpenVINO EP is not installed here or its plugin lists no device (seen on an AMD EPYC)"
    if runtime == "ov" and target == "ort" and not settings.get("rows"):
        return "OpenVINO's GroupQueryAttention appends to the past it is given: only the -rows settings write the cache"
    if runtime == "ov" and target != "ort" and settings.get("rows"):
        return "-rows is for the ort target's GroupQueryAttention (portable graphs scatter into the cache in place)"
    return None


def run_ovgenai_job(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The peer's TTFT at each length, each a fresh OpenVINO GenAI worker (bench/competitors.run_ovgenai):
    load, a 16-token warm-up of other ids, one request of the same ids the prefill settings get, 1 token."""
    from competitors import run_ovgenai

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    python = args.ov_venv / "bin" / "python"
    first = {str(n): run_ovgenai(python, folder, B.prompt_ids(vocab, n), 1, args.threads, 1,
                                 B.prompt_ids(vocab, 16, seed=1), args.timeout).prefill_s for n in args.lens}
    log(f"  {folder.name} openvino-genai: " + " ".join(f"{n}: {1e3 * t:.0f} ms" for n, t in first.items())
        + f" (load {os.getloadavg()[0]:.1f})")
    return {"load_s": 0.0, "first": first, "again": {}}


def run_job(artifact: Path, config: str, args: argparse.Namespace, parity: str, timed: bool) -> dict[str, Any]:
    if config == "openvino-genai":
        return run_ovgenai_job(artifact, args)
    job = {"artifact": str(artifact), "config": config, "threads": args.threads, "lens": args.lens if timed else [],
           "again": args.again,
           "parity": parity, "parity_len": args.parity_len, "parity_gen": args.parity_gen,
           "cache_dir": str(args.work / "ov-cache")}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          timeout=args.timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{artifact.name} {config}: worker failed: {tail[:400]}")
    out = json.loads(lines[-1])
    times = " ".join(f"{n}: {1e3 * out['first'][n]:.0f}" + (f"/{1e3 * out['again'][n]:.0f}" if args.again else "")
                     + " ms" for n in out["first"])
    log(f"  {artifact.name} {config}: {times or 'parity only'} (load {os.getloadavg()[0]:.1f})")
    return out


def spread(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):7.1f} ({1e3 * min(xs):.0f}-{1e3 * max(xs):.0f})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    p = argparse.ArgumentParser(prog="bench/ov_prefill.py", description=__doc__.splitlines()[0])
    p.add_argument("artifacts", type=Path, nargs="*")
    p.add_argument("--lens", default="128,1024,4096")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list (--list); default {DEFAULT_CONFIGS}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--again", action="store_true", help="also time a second call at each length (a warm shape)")
    p.add_argument("--time-refs", action="store_true",
                   help="time ort-cpu on every artifact (default: the first only; the others are parity references)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--parity-len", type=int, default=128)
    p.add_argument("--parity-gen", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--work", type=Path, default=Path("/tmp/decodert-ov-prefill"), help="parity logits go here")
    p.add_argument("--list", action="store_true", help="print the settings and exit")
    p.add_argument("--ovgenai", type=Path, help="also time OpenVINO GenAI on this optimum-cli export (the peer)")
    p.add_argument("--ov-venv", type=Path, default=DEFAULT_OV_VENV, help="the environment OpenVINO GenAI is in")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.list:
        for name, (runtime, settings) in CONFIGS.items():
            log(f"{name:<18} {runtime:<4} {json.dumps(settings)}")
        return 0
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS] + [str(a) for a in args.artifacts if not (a / "manifest.json").is_file()]
    if bad or not args.artifacts:
        log(f"ov_prefill: error: unknown setting or no artifact: {bad or 'give one or more artifact folders'}")
        return 2
    if "ort-cpu" not in configs:
        configs.insert(0, "ort-cpu")  # the parity reference
    args.lens = [int(x) for x in args.lens.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    log(f"machine: {B.machine_info()}")
    jobs = []
    for a in args.artifacts:
        for c in configs:
            why = skipped(a, c)
            if why:
                log(f"  {a.name} {c}: skipped ({why})")
            else:
                jobs.append((a, c))
    if args.ovgenai:
        jobs.append((args.ovgenai, "openvino-genai"))
    timed = [c != "ort-cpu" or a == args.artifacts[0] or args.time_refs for a, c in jobs]
    results = rotate([list(range(len(jobs)))], args.repeats, lambda i: run_job(
        jobs[i][0], jobs[i][1], args, str(args.work / f"{jobs[i][0].name}-{jobs[i][1]}.npy"), timed[i]), log)
    ref0 = (args.artifacts[0], "ort-cpu")
    rows = []
    log(f"\nTTFT ms, median (min-max) of {args.repeats}; 'first' = first call at that length, 'again' = second")
    heads = [f"{w} {n}" for n in args.lens for w in (("first", "again") if args.again else ("first",))]
    log(f"{'artifact':<22} {'setting':<16} " + " ".join(f"{h:>19}" for h in heads) + "  load s  parity")
    for i, (a, c) in enumerate(jobs):
        if i not in results:
            log(f"{a.name:<22} {c:<16} FAILED")
            continue
        rs = results[i]
        parity = []
        for ref in ((a, "ort-cpu"), ref0) if a != ref0[0] and c != "openvino-genai" else ((a, "ort-cpu"),):
            if (ref[0], ref[1]) == (a, c) or ref not in jobs or jobs.index(ref) not in results:
                continue
            mine = np.load(args.work / f"{a.name}-{c}.npy")
            theirs = np.load(args.work / f"{ref[0].name}-{ref[1]}.npy")
            agree = int((mine.argmax(-1) == theirs.argmax(-1)).sum())
            parity.append(f"vs {ref[0].name}/{ref[1]}: max|dlogit| first {np.abs(mine[0] - theirs[0]).max():.3g}, "
                          f"all {np.abs(mine - theirs).max():.3g}; argmax {agree}/{len(mine)}")
        cells = " ".join(f"{spread([r[w][str(n)] for r in rs]) if timed[i] else '-':>19}"
                         for n in args.lens for w in (("first", "again") if args.again else ("first",)))
        log(f"{a.name:<22} {c:<16} {cells} {statistics.median(r['load_s'] for r in rs):6.1f}  {'; '.join(parity)}")
        rows.append({"artifact": str(a), "setting": c, "runs": rs, "parity": parity})
    log(f"load avg {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"machine": B.machine_info(), "configs": {c: CONFIGS[c] for c in configs},
                                         "ovgenai": str(args.ovgenai) if args.ovgenai else None,
                                         "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
