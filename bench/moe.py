"""Mixture-of-experts decode speed against the bandwidth floor of the active parameters, random weights.

    python bench/moe.py [--family qwen3_moe|gpt_oss] [--shape bench|small] [--threads 2] [--gen 64]
                        [--repeats 3] [--cache ~/.cache/decodert-bench/moe] [--genai] [--json moe.json]

1. Writes a random-weight HF checkpoint of the shape once (fp16 safetensors, one shard per layer, so
   writing never holds more than a layer; gpt-oss experts in MXFP4 as OpenAI ships them, which
   onnxruntime-genai's builder requires and decodert dequantizes exactly) with a byte-level BPE tokenizer padded to the vocabulary:
   ``bench`` = 12 layers, hidden 2048, 32 experts of width 768, top-4 (2.1B parameters, 0.48B active:
   4.3x; 1.4 GB of int4 weights); ``small`` = the same at hidden 512 / 4 layers / 16 experts (a smoke run).
2. Exports it with decodert (--target ort, --quant int4: QMoE experts, MatMulNBits elsewhere; block 32,
   accuracy level 4) and, with ``--genai``, builds it with onnxruntime-genai's model builder (int4) where
   the builder takes the family (it has gpt-oss, not Qwen3-MoE).
3. Times batch-1 decode (a 128-token prompt, ``--gen`` tokens, decodert.tools.bench) and prints decode
   tok/s, the floor = read bandwidth / bytes a step reads (the active experts only: tools/bench.py
   bytes_per_step) and the share of it reached. Set the same ``--threads`` for every runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPES: dict[str, dict[str, Any]] = {
    "bench": dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, vocab_size=32000),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=8000),
}


def config(family: str, shape: dict[str, Any]) -> dict[str, Any]:
    """config.json of the family at the shape (gpt-oss: its layer pattern, sinks, biases, YaRN)."""
    base = dict(shape, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
                eos_token_id=2, hidden_act="silu")
    if family == "qwen3_moe":
        return dict(base, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], norm_topk_prob=True,
                    intermediate_size=4 * shape["moe_intermediate_size"], decoder_sparse_step=1, mlp_only_layers=[],
                    rope_theta=1000000.0)
    layers = shape["num_hidden_layers"]
    return dict(base, model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True,
                num_local_experts=base.pop("num_experts"), intermediate_size=base.pop("moe_intermediate_size"),
                sliding_window=128, swiglu_limit=7.0, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    # no quantization_config: with it, onnxruntime-genai's builder loads transformers' MXFP4 kernels from the hub


def _layer_tensors(family: str, c: dict, i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, d, heads, kv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    e = c.get("num_experts") or c["num_local_experts"]
    ie = c.get("moe_intermediate_size") or c["intermediate_size"]
    w = lambda *s: (rng.standard_normal(s, np.float32) * 0.02).astype(np.float16)  # noqa: E731
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    t = {p + "input_layernorm.weight": np.ones(h, np.float16), p + "post_attention_layernorm.weight": np.ones(h, np.float16),
         a + "q_proj.weight": w(heads * d, h), a + "k_proj.weight": w(kv * d, h), a + "v_proj.weight": w(kv * d, h),
         a + "o_proj.weight": w(h, heads * d)}
    if family == "qwen3_moe":
        t |= {a + "q_norm.weight": np.ones(d, np.float16), a + "k_norm.weight": np.ones(d, np.float16),
              p + "mlp.gate.weight": w(e, h)}
        for j in range(e):
            x = f"{p}mlp.experts.{j}."
            t |= {x + "gate_proj.weight": w(ie, h), x + "up_proj.weight": w(ie, h), x + "down_proj.weight": w(h, ie)}
        return t
    for name, n in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d), ("o_proj", h)):
        t[a + name + ".bias"] = w(n)
    t |= {a + "sinks": w(heads), p + "mlp.router.weight": w(e, h), p + "mlp.router.bias": w(e),
          p + "mlp.experts.gate_up_proj_bias": w(e, 2 * ie), p + "mlp.experts.down_proj_bias": w(e, h)}
    for name, (n, k) in (("gate_up_proj", (2 * ie, h)), ("down_proj", (h, ie))):  # MXFP4, as OpenAI ships gpt-oss
        t[p + f"mlp.experts.{name}_blocks"] = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
        t[p + f"mlp.experts.{name}_scales"] = rng.integers(119, 123, (e, n, k // 32), dtype=np.uint8)
    return t


def write_checkpoint(family: str, shape_name: str, folder: Path) -> Path:
    """The random checkpoint (once: reused when its config is there)."""
    from safetensors.numpy import save_file

    c = config(family, SHAPES[shape_name])
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    index: dict[str, str] = {}
    for i in range(c["num_hidden_layers"]):
        name = f"layer-{i:03d}.safetensors"
        tensors = _layer_tensors(family, c, i, rng)
        save_file(tensors, str(folder / name))
        index |= {k: name for k in tensors}
        del tensors
    v, h = c["vocab_size"], c["hidden_size"]
    top = {"model.embed_tokens.weight": (rng.standard_normal((v, h), np.float32) * 0.02).astype(np.float16),
           "lm_head.weight": (rng.standard_normal((v, h), np.float32) * 0.02).astype(np.float16),
           "model.norm.weight": np.ones(h, np.float16)}
    save_file(top, str(folder / "top.safetensors"))
    index |= {k: "top.safetensors" for k in top}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    tokenizer(v).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    (folder / "config.json").write_text(json.dumps(c, indent=1))  # last: marks the folder complete
    return folder


def tokenizer(vocab: int) -> Any:
    """A byte-level BPE of exactly ``vocab`` tokens (ids 0..2 special); speed does not depend on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 2000), special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. " * 50, open(__file__).read()], trainer)
    tok.add_tokens([f"<|filler_{i}|>" for i in range(vocab - tok.get_vocab_size())])
    return tok


def export_decodert(src: Path, out: Path) -> Path:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_model(src, out, target="ort", max_seq=512, max_batch=1, progress=True,
                     quant=QuantConfig(bits=4, block_size=32, accuracy_level=4))
        print(f"export: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def decodert_once(out: Path, threads: int, gen: int) -> tuple[float, Any]:
    """One timed batch-1 run (after one warm-up) -> (decode tok/s, the BenchResult with the floor)."""
    from decodert.tools import bench as B

    r = B.bench(out, B.BenchConfig(prompt_len=128, gen=gen, repeats=1, warmup=1, threads=threads), progress=False)
    return r.results[0].decode_tps.median, r


class Genai:
    """onnxruntime-genai's builder (int4, CPU) on the same checkpoint, then its generator, greedy, EOS ignored."""

    def __init__(self, src: Path, out: Path, threads: int) -> None:
        import subprocess

        self.error = None
        if not (out / "genai_config.json").is_file():
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out), "-p", "int4",
                   "-e", "cpu", "-c", str(out / ".cache")]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                self.error = (res.stderr or res.stdout).strip().splitlines()[-1][:300]
                return
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(out))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.ids = np.random.default_rng(0).integers(3, 1000, 128).tolist()
        self.once(8)  # warm-up

    def once(self, gen: int) -> float:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=128 + gen, min_length=128 + gen, do_sample=False)
        g = self.og.Generator(self.model, params)
        g.append_tokens(self.ids)
        g.generate_next_token()
        t0 = time.perf_counter()
        while not g.is_done():
            g.generate_next_token()
        return (gen - 1) / (time.perf_counter() - t0)


def _spread(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": xs[len(xs) // 2], "min": xs[0], "max": xs[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("qwen3_moe", "gpt_oss"), default="qwen3_moe")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "decodert-bench" / "moe")
    ap.add_argument("--genai", action="store_true", help="also onnxruntime-genai's builder + generator")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)
    base = args.cache / f"{args.family}-{args.shape}"
    src = write_checkpoint(args.family, args.shape, base / "hf")
    out = export_decodert(src, base / "decodert-int4")
    genai = Genai(src, base / "genai-int4", args.threads) if args.genai else None
    runs: dict[str, list[float]] = {"decodert-int4": [], "genai-int4": []}
    last = None
    for rep in range(args.repeats):  # the runtimes alternate, who goes first rotates
        order = ["decodert-int4", "genai-int4"][:: 1 if rep % 2 == 0 else -1]
        for name in order:
            if name == "decodert-int4":
                tps, last = decodert_once(out, args.threads, args.gen)
                runs[name].append(tps)
            elif genai is not None and genai.error is None:
                runs[name].append(genai.once(args.gen))
    c = json.loads((src / "config.json").read_text())
    print(f"{args.family} {args.shape}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"{c.get('num_experts') or c.get('num_local_experts')} experts top-{c['num_experts_per_tok']}, "
          f"threads {args.threads}, {args.repeats} alternating repeats")
    d = _spread(runs["decodert-int4"])
    rows: list[dict[str, Any]] = [{"runtime": "decodert-int4", "decode_tps": d, "bytes_per_step": last.bytes_per_step,
                                   "weights_file_bytes": last.weights_file_bytes, "read_gbps": last.read_gbps,
                                   "floor_tps": last.floor_tps, "floor_pct": 100 * d["median"] / last.floor_tps}]
    print(f"  decodert-int4  decode {d['median']:.1f} tok/s ({d['min']:.1f}-{d['max']:.1f})  floor {last.floor_tps:.1f} tok/s "
          f"({last.bytes_per_step / 2**20:.0f} MiB/step, active experts only, at {last.read_gbps:.1f} GB/s) -> "
          f"{rows[0]['floor_pct']:.0f}%  (weights file {last.weights_file_bytes / 2**30:.2f} GiB)")
    if genai is not None and genai.error:
        rows.append({"runtime": "genai-int4", "error": genai.error})
        print(f"  genai-int4     failed: {genai.error}")
    elif genai is not None:
        gs = _spread(runs["genai-int4"])
        rows.append({"runtime": "genai-int4", "decode_tps": gs})
        print(f"  genai-int4     decode {gs['median']:.1f} tok/s ({gs['min']:.1f}-{gs['max']:.1f})  "
              f"decodert x{d['median'] / gs['median']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
