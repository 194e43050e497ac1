"""Decode throughput with LoRA adapters: a batch of 4 rows, each with its own adapter, against the base model.

    python bench/lora.py --threads 2 --steps 64 --repeats 5 [--quant int4] [--work /tmp/lora_bench]

Exports SmolLM2-135M twice (once plain, once with ``--lora-slots 4 --lora-rank 16``), writes 4 random
rank-16 PEFT adapters on every projection (q, k, v, o, gate, up, down: the files PEFT writes), and times
decode steps of batch 4 straight on the ort backend (prefill of a 32-token prompt per row, then ``--steps``
one-token steps x ``--repeats``), one step of each configuration in turn, each on its own cache:

    base          the plain artifact (no LoRA inputs)
    lora-4        the LoRA artifact, rows on adapters 1, 2, 3, 4 (four different adapters in one step)
    lora-none     the LoRA artifact, every row without an adapter (the price of the inputs alone)

Prints tok/s = 4 / the median step time of each (a step the OS descheduled on a shared machine does not
move a median) and lora-4 / base (the issue's goal: >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, spec, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for ``spec``."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    q, kv, h, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, spec.mlp_size(0)
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    tensors = {}
    for i in range(spec.num_layers):
        for module, (n_in, n_out) in dims.items():
            block = "self_attn" if module in ALL[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * rng.standard_normal((rank, n_in))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((n_out, rank))).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(ALL), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def exported(src: Path, out: Path, quant: str, lora) -> Path:
    from decodert.export.pipeline import export_model
    from decodert.export.quantize.quant import QuantConfig

    if not (out / "manifest.json").is_file():
        q = None if quant == "none" else QuantConfig(bits=4, block_size=32)
        export_model(src, out, max_seq=256, max_batch=4, progress=False, quant=q, lora=lora)
    return out


class Run:
    """One configuration: a backend with its own cache of 4 rows, prefilled, stepped one decode at a time."""

    def __init__(self, backend, adapters: list[tuple[int, int]], prompt: np.ndarray) -> None:
        self.backend, self.slots = backend, list(range(len(adapters)))
        self.cache = backend.allocate(len(adapters))
        for s, (index, tag) in enumerate(adapters):
            self.cache.use_adapter(s, index, tag)
        self.ids = backend.prefill(self.cache, self.slots, [prompt] * len(self.slots), want_logits=False).next_token
        self.times: list[float] = []

    def step(self) -> None:
        if self.cache.lengths.max() + 1 >= self.backend.max_seq:  # start over: same prompt, same work per step
            for s in self.slots:
                self.cache.reset(s)
            self.ids = self.backend.prefill(self.cache, self.slots, [self.ids[:1]] * len(self.slots), False).next_token
        start = time.perf_counter()
        self.ids = self.backend.decode(self.cache, self.slots, self.ids, want_logits=False).next_token
        self.times.append(time.perf_counter() - start)


def main() -> None:
    from decodert.export.fetch import smollm2_gguf
    from decodert.artifact.lora_layout import LoraLayout
    from decodert.runtime.adapters import Adapters
    from decodert.runtime.backends.loading import read_manifest
    from decodert.runtime.backends.ort.backend import OrtBackend

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quant", choices=["none", "int4"], default="none")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--work", type=Path, default=Path("/tmp/lora_bench"))
    args = p.parse_args()
    src = smollm2_gguf()
    base_dir = exported(src, args.work / f"base-{args.quant}", args.quant, None)
    lora_dir = exported(src, args.work / f"lora-{args.quant}-r{args.rank}", args.quant, LoraLayout(4, args.rank))
    base = OrtBackend(base_dir, read_manifest(base_dir, "none"), threads=args.threads)
    manifest = read_manifest(lora_dir, "none")
    lora = OrtBackend(lora_dir, manifest, threads=args.threads)
    table = Adapters(manifest.lora_layout, manifest.model.spec(), lora.lora_weights)
    loaded = [table.load(f"a{k}", write_adapter(args.work / f"adapter{k}-r{args.rank}", manifest.model.spec(), args.rank, k))
              for k in range(4)]
    prompt = np.random.default_rng(0).integers(100, 40000, 32).astype(np.int64)
    runs = {"base": Run(base, [(0, 0)] * 4, prompt),
            "lora-4": Run(lora, [(a.slot, a.tag) for a in loaded], prompt),
            "lora-none": Run(lora, [(0, 0)] * 4, prompt)}
    names = list(runs)
    for r in range(args.repeats * args.steps):  # one step of each in turn: drift falls on every run alike
        for name in names[r % 3:] + names[: r % 3]:
            runs[name].step()
    steps = {k: run.times for k, run in runs.items()}
    # tok/s = 4 / the median step: a step the OS descheduled (a shared machine) does not move it
    med = {k: 4 / statistics.median(v) for k, v in steps.items()}
    print(f"SmolLM2-135M {args.quant} weights, batch 4, {args.steps} decode steps x {args.repeats} repeats, "
          f"{args.threads} threads, rank {args.rank}, 4 slots")
    for k in runs:
        print(f"  {k:10s} {med[k]:7.1f} tok/s (median step; mean step {4 * len(steps[k]) / sum(steps[k]):.1f} tok/s)")
    print(f"  lora-4 / base = {med['lora-4'] / med['base']:.3f}   lora-none / base = {med['lora-none'] / med['base']:.3f}")


if __name__ == "__main__":
    main()
