"""Decode cost against the context: hybrids (Qwen3.5, Gated DeltaNet in 3 of 4 layers; a Nemotron-H-shaped
Mamba2 hybrid) beside a dense model (Qwen3-0.6B's shape), random weights, fp32 and int4, on ONNX Runtime CPU.

    python bench/hybrid.py [--shapes qwen3.5-0.8b,qwen3-0.6b,nemotron-h-1k] [--precisions fp32,int4]
                           [--contexts 512,4096,16384] [--runtimes decodert,genai] [--steps 32]
                           [--repeats 3] [--threads 2] [--cache ~/.cache/decodert-bench] [--json hybrid.json]

1. Writes each shape's random-weight HF checkpoint once (Qwen3.5 as a ``qwen3_5`` image-text checkpoint
   with a one-block vision tower, which onnxruntime-genai's builder expects and decodert exports beside the
   text graphs, whose attention then turns by M-RoPE as a real Qwen3.5 export's does) and
   exports it: decodert fp32 / int4 (block 32, accuracy level 4, min/max grids: MatMulNBits for every
   projection, DeltaNet's included), onnxruntime-genai fp32 / int4 with its builder where it accepts the model.
2. A decodert run sets a row's context by committing N ids to its cache without running the prefill
   (a step's cost depends on the length, not on what the cache holds), then times ``--steps`` decode
   steps; onnxruntime-genai has no such door, so it prefills N tokens first. One fresh worker process
   per run (threads pinned), the runtimes of one (shape, context) alternating, the first rotating.
3. Prints the median step (ms) and tok/s per shape, precision and context; the ratio of the step at
   the longest context to the shortest (the goal: <= 1.25 for the hybrid at 16k vs 512); and the
   bandwidth floor: weight bytes + the K/V read at that context + the states read and written, over
   the measured read bandwidth (decodert.tools.bench's probe), with the % of it reached.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np
from rotation import rotate
from sizes_models import SHAPES as DENSE_SHAPES

from decodert.tools import bench as B

# Qwen3.5-0.8B's published text config (24 layers: every 4th full attention, head_dim 256 with a quarter
# rotary; 16 + 16 DeltaNet heads of 128), tied embeddings over a 248k vocabulary
QWEN35_08B = dict(
    vocab_size=248_320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=16, max_position_embeddings=262_144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
# Nemotron-H-8B's block pattern and ratios (Mamba2 heads of 64, state 128, 8 groups; GQA heads of 128; ReLU² MLP
# 5.25x hidden; its 131k vocabulary, untied), scaled to hidden 1024 and its first 24 blocks: 11 Mamba2, 2 attention,
# 11 MLP blocks: 0.49B parameters, 0.22B of them outside the embeddings
NEMOTRON_H_1K = dict(
    vocab_size=131_072, hidden_size=1024, intermediate_size=5376, hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-",
    mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=262_144, layer_norm_epsilon=1e-5,
    mlp_hidden_act="relu2", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "qwen3.5-0.8b": {"model_type": "qwen3_5", "text": QWEN35_08B},
    "nemotron-h-1k": {"model_type": "nemotron_h", "text": NEMOTRON_H_1K},
    "qwen3-0.6b": {"model_type": "qwen3", "text": DENSE_SHAPES["qwen3-0.6b"]},
    "tiny": {"model_type": "qwen3_5", "text": {**QWEN35_08B, "vocab_size": 4096, "hidden_size": 64,
                                               "intermediate_size": 128, "num_hidden_layers": 4, "head_dim": 32,
                                               "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                               "rope_parameters": {**QWEN35_08B["rope_parameters"],  # 4 rotary pairs
                                                                   "mrope_section": [2, 1, 1]}}},
}
VISION = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2)  # a one-block tower: decodert exports it too
# Qwen3.5's preprocessor_config.json (Qwen2VLImageProcessor with 16-px patches): the tower's settings, which decodert
# checks at export
PREPROCESSOR = dict(image_processor_type="Qwen2VLImageProcessor", patch_size=16, temporal_patch_size=2, merge_size=2,
                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                    size={"shortest_edge": 65_536, "longest_edge": 16_777_216})


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- checkpoints and exports ---------------------------------------------------------------------
def hf_checkpoint(name: str, cache: Path) -> Path:
    """The random-weight HF folder of shape ``name`` (written once; seed 0)."""
    folder = cache / f"hybrid-{name}"
    if (folder / "config.json").is_file():
        return folder
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "helpers"))
    from tiny import make_tokenizer

    shape = SHAPES[name]
    text = {k: v for k, v in shape["text"].items() if k not in ("architectures", "model_type")}
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    if shape["model_type"] == "qwen3_5":
        config = Qwen3_5Config(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                               tie_word_embeddings=text["tie_word_embeddings"],
                               image_token_id=min(248_056, text["vocab_size"] - 1))  # the default, in a small vocab
        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape["model_type"], **text), dtype=torch.float32)
    model.save_pretrained(tmp)
    del model
    if shape["model_type"] == "qwen3_5":
        (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    make_tokenizer(text["vocab_size"]).save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}))
    tmp.rename(folder)
    return folder


def prepare(name: str, runtime: str, prec: str, max_seq: int, args: argparse.Namespace) -> Path | None:
    hf = hf_checkpoint(name, args.cache)
    if runtime == "genai":
        from competitors import build_ortgenai

        try:
            return build_ortgenai(hf, args.cache / f"hybrid-{name}-genai-{prec}", prec, args.threads)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log(f"  {name} genai-{prec}: the builder refused it ({str(e)[:200]})")
            return None
    kv = "" if args.kv_dtype == "fp32" else f"-kv{args.kv_dtype}"
    folder = args.cache / f"hybrid-{name}-decodert-{prec}-{max_seq}{kv}"
    if not (folder / "manifest.json").is_file():
        from decodert.export.pipeline import export_model
        from decodert.export.quantize.quant import QuantConfig

        # min/max rounding: speed does not depend on the grid, and the scale search takes minutes at this size
        quant = QuantConfig(bits=4, block_size=32, accuracy_level=4, scale_search=False) if prec == "int4" else None
        export_model(hf, folder, max_seq=max_seq, max_batch=1, progress=False, quant=quant, kv_dtype=args.kv_dtype)
    return folder


# ---- one timed run per worker process --------------------------------------------------------------
def worker(spec: str) -> int:
    job = json.loads(spec)
    ctx, steps, vocab = job["context"], job["steps"], job["vocab"]
    ids = B.prompt_ids(vocab, ctx)
    if job["runtime"] == "genai":
        from competitors import OrtGenaiRunner

        timing = OrtGenaiRunner(Path(job["path"]), 1).run(ids, steps + 1)
        print(json.dumps({"step_s": timing.step_s.tolist()}))
        return 0
    from decodert.runtime.backends.loading import open_backend, read_manifest

    os.environ["DECODERT_THREADS"] = str(job["threads"])
    be = open_backend(Path(job["path"]), read_manifest(Path(job["path"])), "ort")
    cache = be.allocate(1)
    token = np.array([int(ids[-1])], np.int64)
    for _ in range(4):  # warm-up at the context: thread pools, buffers, the attention's working set
        cache.reset(0)
        cache.commit([0], [ids[:-1]])
        be.decode(cache, [0], token, want_logits=False)
    cache.reset(0)
    cache.commit([0], [ids[:-1]])  # the row now holds ctx - 1 tokens: the first step is at context ctx
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = be.decode(cache, [0], token, want_logits=False).next_token
        times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": times}))
    return 0


def run(job: dict, args: argparse.Namespace) -> list[float]:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                          timeout=args.timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{job['shape']} {job['runtime']}-{job['prec']} @{job['context']}: {tail[:300]}")
    return json.loads(lines[-1])["step_s"]


# ---- the bandwidth floor ---------------------------------------------------------------------------
def step_bytes(folder: Path, ctx: int) -> int:
    """Bytes one batch-1 step reads at context ``ctx``: weights, K/V of every attention layer, states x2."""
    from decodert.runtime.backends.loading import read_manifest

    from decodert.artifact.graph_contract import kv_storage

    m = read_manifest(folder)
    item = {"fp32": 4, "fp16": 2, "bf16": 2}[m.dtype]
    kv = 2 * m.kv.num_layers * m.kv.num_kv_heads * ctx * kv_storage(m).bytes_per_position(m.kv.head_dim)
    return B.bytes_per_step(folder, m) + kv + 2 * m.kv.state_bytes(1, item)


def report(rows: list[dict], gbps: float) -> str:
    lines = [f"read bandwidth {gbps:.1f} GB/s", "",
             "| shape | runtime | context | step ms (min-max) | tok/s | floor ms | % of floor |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        floor = r["bytes"] / gbps / 1e6 if r["bytes"] else float("nan")
        lines.append(f"| {r['shape']} | {r['runtime']}-{r['prec']} | {r['context']} | {r['ms']:.2f} "
                     f"({r['min']:.2f}-{r['max']:.2f}) | {1e3 / r['ms']:.1f} | {floor:.2f} | {100 * floor / r['ms']:.0f}% |")
    lines.append("")
    groups: dict[tuple, dict[int, float]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["runtime"], r["prec"]), {})[r["context"]] = r["ms"]
    for (shape, rt, prec), by_ctx in groups.items():
        lo, hi = min(by_ctx), max(by_ctx)
        lines.append(f"{shape} {rt}-{prec}: step at {hi} / step at {lo} = {by_ctx[hi] / by_ctx[lo]:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3.5-0.8b,qwen3-0.6b")
    p.add_argument("--precisions", default="fp32,int4")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--runtimes", default="decodert,genai")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--probe-mib", type=int, default=1024)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "decodert-bench")
    p.add_argument("--json", type=Path)
    p.add_argument("--kv-dtype", default="fp32", help="decodert's K/V cache type (fp32 | fp16 | int8: --kv-dtype)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    args = parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    max_seq = max(contexts) + args.steps + 16
    jobs, groups = [], []
    for shape in args.shapes.split(","):
        for prec in args.precisions.split(","):
            for runtime in args.runtimes.split(","):
                path = prepare(shape, runtime, prec, max_seq, args)
                if path is None:
                    continue
                for ctx in contexts:
                    jobs.append(dict(shape=shape, runtime=runtime, prec=prec, context=ctx, path=str(path),
                                     steps=args.steps, threads=args.threads, vocab=SHAPES[shape]["text"]["vocab_size"]))
    for key in dict.fromkeys((j["shape"], j["prec"], j["context"]) for j in jobs):
        groups.append([i for i, j in enumerate(jobs) if (j["shape"], j["prec"], j["context"]) == key])
    results = rotate(groups, args.repeats, lambda i: run(jobs[i], args), log)
    gbps = B.memread_gbps(args.probe_mib, threads=args.threads)
    rows = []
    for i, steps in results.items():
        j, meds = jobs[i], [1e3 * median(s) for s in steps]
        nbytes = step_bytes(Path(j["path"]), j["context"]) if j["runtime"] == "decodert" else 0
        rows.append({**{k: j[k] for k in ("shape", "runtime", "prec", "context")}, "ms": median(meds),
                     "min": min(meds), "max": max(meds), "bytes": nbytes})
    rows.sort(key=lambda r: (r["shape"], r["runtime"], r["prec"], r["context"]))
    log(report(rows, gbps))
    if args.json:
        args.json.write_text(json.dumps({"gbps": gbps, "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
