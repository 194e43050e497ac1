"""``decodert verify OUT``: the TensorRT engines against ONNX Runtime (CPU) running the same ONNX graphs.

Teacher-forced greedy: both sides are fed the tokens TensorRT chose, so one near-tie flip does not
derail the rest of the comparison. Each step counts whether ONNX Runtime's argmax agrees with the
engine's ``next_token`` and tracks the largest logit difference. Where the engines include a
verify engine (speculative decoding), one verify call over the tokens the decode steps were fed
must return what those steps did. ``--bench`` adds decode
throughput at the given batch sizes with and without CUDA graphs. Needs a GPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from decodert.artifact.manifest import Manifest, load_manifest
from decodert.artifact.targets import target_info

GRAPHS = ("prefill", "decode")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "1, 2, 3, 4, 5,")


class OrtGraphReference:
    """prefill.onnx / decode.onnx on ONNX Runtime CPU; numpy KV [rows, Hkv, Smax, D]; rows = slots 0..n-1."""

    def __init__(self, artifact_dir: Path, manifest: Manifest, rows: int) -> None:
        import ml_dtypes
        import onnxruntime as ort

        from decodert.runtime.backends.trt.engine import kv_pairs

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        from decodert.runtime.backends.ort_session import open_session  # expands --plugins nodes

        self.sessions = {k: open_session(artifact_dir / manifest.graphs[k].file, opts, ["CPUExecutionProvider"])
                         for k in GRAPHS}
        kv = manifest.kv
        dtype = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32}[manifest.dtype]
        self.pairs = kv_pairs(manifest.graphs["decode"])  # [(past_key.0, present_key.0), ...]
        self.past = [past for past, _ in self.pairs]
        dims = [d for d in kv.dims for _ in range(2)]  # each cache's head_dim (Gemma 4: the full layers' differ)
        self.kv = {name: np.zeros((rows, kv.num_kv_heads, manifest.max_seq, d), dtype) for name, d in zip(self.past, dims)}
        self.lengths = np.zeros(rows, np.int64)  # [rows]

    def _run(self, kind: str, ids: np.ndarray, seq_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = ids.shape[0]  # ids [n, S]
        feeds = {"input_ids": ids, "past_lengths": self.lengths[:n].copy(), "seq_lengths": seq_lengths,
                 **{name: buf[:n] for name, buf in self.kv.items()}}
        names = ["logits", "next_token", *[present for _, present in self.pairs]]
        logits, next_token, *present = self.sessions[kind].run(names, feeds)
        for name, value in zip(self.past, present):
            self.kv[name][:n] = value
        self.lengths[:n] += seq_lengths
        return next_token, logits

    def prefill(self, rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        lens = np.array([len(r) for r in rows], np.int64)
        ids = np.zeros((len(rows), int(lens.max())), np.int64)  # right-padded [n, S]
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        return self._run("prefill", ids, lens)

    def decode(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._run("decode", tokens.reshape(-1, 1).astype(np.int64), np.ones(len(tokens), np.int64))


def default_prompts(artifact_dir: Path, manifest: Manifest, n: int) -> list[np.ndarray]:
    """Token ids of fixed English/code prompts (tokenizer.json), or fixed pseudo-random ids without one."""
    path = artifact_dir / manifest.tokenizer.file
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return [np.array(tok.encode(PROMPTS[i % len(PROMPTS)]).ids, np.int64) for i in range(n)]
    rng = np.random.default_rng(0)
    vocab = manifest.model.vocab_size
    return [rng.integers(0, vocab, size=5 + 3 * i).astype(np.int64) for i in range(n)]


def verify(artifact_dir: str | Path, steps: int = 16, rows: int = 2, cuda_graphs: bool = True) -> dict[str, Any]:
    """Prefill ``rows`` prompts and decode ``steps`` tokens on both; return agreement and logit error."""
    from decodert.runtime.backends.trt.backend import TrtBackend

    folder = Path(artifact_dir)
    manifest = load_manifest(folder, verify="fast")
    check_verifiable(folder, manifest)
    with TrtBackend(folder, manifest, cuda_graphs=cuda_graphs) as be:
        rows = min(rows, be.max_batch)
        prompts = default_prompts(folder, manifest, rows)
        steps = min(steps, be.max_seq - max(len(p) for p in prompts))
        ref = OrtGraphReference(folder, manifest, rows)
        cache, slots = be.allocate(rows), list(range(rows))
        got, want = be.prefill(cache, slots, prompts, want_logits=True), ref.prefill(prompts)
        stats = _Compare()
        stats.add(got.next_token, got.logits, *want)
        prompt_end, decoded = cache.lengths.copy(), []
        for _ in range(steps):
            tokens = got.next_token.copy()
            got, want = be.decode(cache, slots, tokens, want_logits=True), ref.decode(tokens)
            stats.add(got.next_token, got.logits, *want)
            if got.logits is None:  # asked for above: a backend that drops them is a bug, not a mismatch
                raise RuntimeError("the backend returned no logits from a decode step asked for them")
            decoded.append((tokens, got.next_token.copy(), got.logits.copy()))
        summary = {"rows": rows, "steps": steps + 1, **stats.summary()}
        if be.verify_width and decoded:  # the verify engine over the same tokens (speculative decoding)
            for s in slots:
                cache.rewind(s, int(prompt_end[s]))
            summary.update(_verify_pass(be, cache, slots, decoded[: be.verify_width]))
        return {**summary, "backend_stats": dict(be.stats)}


def _verify_pass(be: Any, cache: Any, slots: list[int], decoded: Sequence[tuple[np.ndarray, ...]]) -> dict[str, Any]:
    """One verify call over the tokens the decode steps were fed, from the same cache state:
    its output after each must be the decode step's (what makes speculative greedy exact)."""
    fed = np.stack([tokens for tokens, _, _ in decoded], axis=1)  # [rows, w]
    out = be.verify(cache, slots, list(fed), want_logits=True)
    stats = _Compare()
    for i, (_, next_token, logits) in enumerate(decoded):
        stats.add(out.next_tokens[:, i], out.logits[:, i], next_token, logits)
    s = stats.summary()
    return {"verify_width": fed.shape[1], "verify_agreement": s["greedy_agreement"],
            "verify_max_abs_logit_err": s["max_abs_logit_err"]}


def check_verifiable(folder: Path, manifest: Manifest) -> None:
    """One-line errors that say the next step: the right target, engines built, a GPU visible."""
    from decodert.errors import DecodertError
    from decodert.plugins.cuda_mem import gpu_count

    if not target_info(manifest.target).runs_on("trt"):  # no TensorRT engines can be built from it
        raise DecodertError(f"{folder} is a --target {manifest.target} artifact; verify compares TensorRT engines "
                            f"with ONNX Runtime: export with --target trt, then `decodert build OUT` and verify that")
    if not manifest.engines:
        raise DecodertError(f"{folder} has no TensorRT engines yet; run `decodert build {folder}`, then verify")
    if gpu_count() == 0:
        raise DecodertError(f"verify runs the TensorRT engines and needs an NVIDIA GPU, and none is visible here; "
                            f"on this machine `decodert generate {folder} --backend ort --prompt ...` runs the graphs")


class _Compare:
    def __init__(self) -> None:
        self.agree = self.total = 0
        self.max_abs = self.max_scale = 0.0

    def add(self, trt_next: np.ndarray, trt_logits: Any, ref_next: np.ndarray, ref_logits: np.ndarray) -> None:
        self.agree += int((trt_next == ref_logits.argmax(-1)).sum())
        self.total += len(trt_next)
        self.max_abs = max(self.max_abs, float(np.abs(trt_logits - ref_logits).max()))
        self.max_scale = max(self.max_scale, float(np.abs(ref_logits).max()))

    def summary(self) -> dict[str, Any]:
        return {"greedy_agreement": self.agree / max(self.total, 1), "max_abs_logit_err": self.max_abs,
                "max_rel_logit_err": self.max_abs / max(self.max_scale, 1e-9)}


def bench(artifact_dir: str | Path, batches: Sequence[int] = (1, 4), steps: int = 64) -> list[dict[str, Any]]:
    """Decode tokens/s per batch size, with and without CUDA graphs (greedy, no logits copied)."""
    from decodert.runtime.backends.trt.backend import TrtBackend

    folder = Path(artifact_dir)
    manifest = load_manifest(folder, verify="fast")
    results = []
    with TrtBackend(folder, manifest) as be:
        batches = [b for b in batches if b <= be.max_batch]
        cache = be.allocate(max(batches))
        steps = min(steps, be.max_seq - 16 - 3)
        for b in batches:
            for graphs in (True, False):
                be.cuda_graphs = graphs
                results.append({"batch": b, "cuda_graphs": graphs, **_time_decode(be, cache, b, steps)})
    return results


def _time_decode(be: Any, cache: Any, batch: int, steps: int) -> dict[str, float]:
    cache.reset()
    slots = list(range(batch))
    tokens = be.prefill(cache, slots, [np.arange(1, 17, dtype=np.int64)] * batch, want_logits=False).next_token
    for _ in range(3):  # the first call runs plainly (JIT), the second captures the graph
        tokens = be.decode(cache, slots, tokens, want_logits=False).next_token
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = be.decode(cache, slots, tokens, want_logits=False).next_token
    dt = time.perf_counter() - t0
    return {"ms_per_step": 1e3 * dt / steps, "tokens_per_s": batch * steps / dt}


def format_report(result: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    lines = []
    if result is not None:
        lines.append(f"verify: {result['rows']} rows x {result['steps']} steps  greedy agreement "
                     f"{result['greedy_agreement']:.3f}  max |logit err| {result['max_abs_logit_err']:.4f} "
                     f"(rel {result['max_rel_logit_err']:.2e})  {result['backend_stats']}")
        if "verify_width" in result:
            lines.append(f"verify pass: {result['verify_width']} tokens a row vs the decode steps  agreement "
                         f"{result['verify_agreement']:.3f}  max |logit err| {result['verify_max_abs_logit_err']:.4f}")
    if rows:
        lines.append(f"{'batch':>5} {'cuda graphs':>11} {'ms/step':>9} {'tokens/s':>10}")
        lines += [f"{r['batch']:>5} {str(r['cuda_graphs']):>11} {r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f}"
                  for r in rows]
    return "\n".join(lines)
