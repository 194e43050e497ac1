"""Vision encode alone (issue 35): decodert's vision.onnx on ONNX Runtime CPU beside transformers' own vision
tower in torch on CPU (the reference peer: onnxruntime-genai has no vision path for these models), the same
random checkpoint, the same preprocessed pixels, the same thread count, and both against the FLOP floor.

    python bench/vision_encode.py [--model smolvlm|qwen2_5_vl] [--depth-frac 0.25] [--threads 2] [--repeats 3]
                                  [--work /tmp/decodert-vision-bench] [--no-torch] [--json out.json]

The checkpoints and artifacts are bench/vision.py's (made here when missing, in the same ``--work`` folder):
SmolVLM-256M-shaped (one 448x448 image = 17 tiles of 512 px with SmolVLM's own processor) or Qwen2.5-VL-3B-shaped
(448x448 -> 1024 patches, 256 tokens; ``--depth-frac`` of its 32 ViT layers). For Qwen the bf16 checkpoint is
deleted after the export; its vision tower's tensors are kept beside the artifact (``torch-<tag>/``) for torch.

Per repeat, alternating decodert and torch (who goes first rotates): decodert's ``vision.onnx`` run on the
preprocessed pixels (preprocessing, numpy + Pillow, timed apart), torch's tower (``get_image_features``:
encoder + connector/merger) under ``torch.no_grad`` with ``torch.set_num_threads(threads)``. Medians.

FLOP floor: the multiply-adds of the encode (2 FLOP each: every linear, the attention's two products per head
over the keys each query really sees, the patch embedding) over the rate of one large fp32 GEMM on the same
threads (torch's, 2048^3, the better of before and after the timed runs), the best this CPU does in fp32; the
max |difference| of the two outputs is printed too (the same weights: fp32 noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vision as vb  # noqa: E402  (bench/vision.py: the checkpoints)


def encode_flops(spec, patches: int, tiles: int, windows: list[int] | None) -> float:
    """FLOPs of one encode: ``patches`` per tile (``tiles`` tiles), ``windows`` the window sizes in patches
    of the windowed layers (None: every layer full)."""
    c, i, n = spec.hidden_size, spec.intermediate_size, patches
    if spec.tower == "qwen_vit":
        per_patch = 3 * c * c + c * c + 3 * c * i  # qkv, o, gate|up, down
        embed = 3 * spec.temporal_patch_size * spec.patch_size ** 2 * c
        r2 = spec.scale_factor ** 2
        merger = (c * r2) ** 2 + c * r2 * spec.out_hidden  # per merged token
        total = n * embed + spec.num_layers * n * per_patch + n // r2 * merger
        for layer in range(spec.num_layers):
            seen = n if windows is None or layer in spec.full_layers else sum(w * w for w in windows) / n
            total += 2 * n * seen * c  # q k^T and p v, all heads
        return 2.0 * total * tiles
    per_patch = 4 * c * c + 2 * c * i
    embed = 3 * spec.patch_size ** 2 * c
    tokens = n // spec.scale_factor ** 2
    proj = tokens * (c * spec.scale_factor ** 2) * spec.out_hidden
    total = n * embed + spec.num_layers * (n * per_patch + 2 * n * n * c) + proj
    return 2.0 * total * tiles


def gemm_rate(threads: int) -> float:
    """FLOP/s of a 2048^3 fp32 GEMM in torch on ``threads`` threads (best of 5)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 ** 3 / best


def artifact(args) -> tuple[Path, Path]:
    """(artifact, torch reference: checkpoint folder or tower folder) of ``args.model``, made when missing."""
    return vb.smol_artifact(args.work, True) if args.model == "smolvlm" else vb.qwen_artifact(args.work, args.depth_frac)


def rebuild_graph(art: Path) -> None:
    """vision.onnx of ``art`` built again by this checkout's export code over the same weights.bin (no re-export:
    the before/after of a graph change on one artifact)."""
    import onnx

    from decodert.artifact.artifact_files import file_record
    from decodert.artifact.manifest import write_manifest
    from decodert.export.lowering.targets import get_target
    from decodert.export.lowering.vision_graph import build_vision_graph
    from decodert.models.vision import VisionSpec
    from decodert.runtime.backends.loading import read_manifest

    manifest = read_manifest(art, verify="none")
    path = art / manifest.vision.graph.file
    old = onnx.load(str(path), load_external_data=False)
    weights = {t.name: t for t in old.graph.initializer if t.name.startswith("vision.")}
    spec = VisionSpec.from_dict(dict(manifest.vision.spec))
    low = get_target(manifest.target).lowering
    onnx.save_model(build_vision_graph(spec, manifest.dtype, weights, old.ir_version, low), str(path))
    files = {**manifest.files, manifest.vision.graph.file: file_record(path)}
    write_manifest(art, manifest.replace(files=files))  # the artifact loads as before (its files verified)


def torch_smolvlm(hf: Path):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    del model.model.text_model, model.lm_head

    def run(pixels: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model.model.get_image_features(torch.from_numpy(pixels)[None]).pooler_output
        return torch.cat(list(out)).numpy()
    return run


def torch_qwen(tower: Path, grid: tuple[int, int]):
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vc = Qwen2_5_VLConfig(vision_config=json.loads((tower / "vision_config.json").read_text())).vision_config
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(vc, dtype=torch.float32).eval()
    state = {k.split("visual.", 1)[-1]: v.float() for k, v in load_file(str(tower / "visual.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    thw = torch.tensor([[1, *grid]])

    def run(pixels: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(pixels), grid_thw=thw).pooler_output.numpy()
    return run


def measure(art: Path, peer: Path, threads: int, repeats: int, torch: bool = True, also: Sequence[str] = (),
            profile: Path | None = None) -> dict:
    """Encode times (s) of decodert's vision.onnx (and the graph files ``also``) and torch's tower; FLOPs and the
    floor; ``profile``: a folder for ONNX Runtime's profile of vision.onnx, printed by op type."""
    import torch as pt

    from decodert.models.vision import VisionSpec
    from decodert.runtime.backends.loading import read_manifest
    from decodert.runtime.backends.ort_session import open_session, session_options
    from decodert.runtime.vision import qwen_preprocess as qp
    from decodert.runtime.vision.encoder import Vision

    manifest = read_manifest(art, verify="none")  # vision.onnx may have been rebuilt
    spec = VisionSpec.from_dict(dict(manifest.vision.spec))
    settings = dict(manifest.vision.processor)
    options = session_options(threads)
    if profile is not None:
        options.enable_profiling, options.profile_file_prefix = True, str(profile / "vision-profile")
    session = open_session(art / manifest.vision.graph.file, options, ["CPUExecutionProvider"])
    vision = Vision(session, spec, settings, 0, np.float32)
    pt.set_num_threads(threads)
    rgb = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    if vision.qwen:
        plain = qp.preprocess(rgb, settings, replace(spec, window_size=0))  # transformers' patch order
        p = qp.preprocess(rgb, settings, spec)
        grid = (p.rows * spec.scale_factor, p.cols * spec.scale_factor)
        side = spec.window_size // spec.patch_size
        windows = [min(side, grid[0] - r) * min(side, grid[1] - c) for r in range(0, grid[0], side)
                   for c in range(0, grid[1], side)] if spec.window_size else None
        flops, torch_in = encode_flops(spec, len(p.pixels), 1, windows), plain.pixels
        feed = {"pixel_values": p.pixels, "patch_positions": p.positions, "patch_windows": p.windows}
        peer_run = torch_qwen(peer, grid) if torch else None
    else:
        tiles = vision.processor.preprocess(rgb, settings)
        flops, torch_in = encode_flops(spec, spec.patches_per_side ** 2, len(tiles.pixels), None), tiles.pixels
        feed = {"pixel_values": tiles.pixels}
        peer_run = torch_smolvlm(peer) if torch else None

    def ours(sess) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            out = sess.run(["image_embeds"], feed)[0]
            return out.reshape(-1, out.shape[-1]) if not vision.qwen else out[p.restore]
        return run

    runners = {"decodert": ours(session), **({"torch": lambda: peer_run(torch_in)} if peer_run else {})}
    for other in also:  # the same feed through another graph file of the artifact (a before/after)
        runners[f"decodert[{other}]"] = ours(open_session(art / other, session_options(threads),
                                                          ["CPUExecutionProvider"]))
    outputs = {name: run() for name, run in runners.items()}  # warm-up (and the outputs compared)
    rate = gemm_rate(threads)  # before and after the timed runs: the better one (a loaded machine lowers it)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(repeats):
        names = list(runners)
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    qp.preprocess(rgb, settings, spec) if vision.qwen else vision.processor.preprocess(rgb, settings)
    pre_s = time.perf_counter() - t0
    if profile is not None:
        print_profile(Path(session.end_profiling()))
    rate = max(rate, gemm_rate(threads))
    out = {"gflop": flops / 1e9, "gemm_gflops": rate / 1e9, "floor_s": flops / rate, "preprocess_s": pre_s,
           "image_tokens": int(outputs["decodert"].shape[0])}
    for name, t in times.items():
        out[f"{name}_s"] = statistics.median(t)
        out[f"{name}_floor_fraction"] = out["floor_s"] / out[f"{name}_s"]
    for name in [n for n in outputs if n.startswith("decodert[")]:
        out[f"{name}_max_abs_diff"] = float(np.abs(outputs["decodert"] - outputs[name]).max())
    if "torch" in outputs:
        out["max_abs_diff"] = float(np.abs(outputs["decodert"] - outputs["torch"]).max())
        out["max_abs_ref"] = float(np.abs(outputs["torch"]).max())
    return out


def print_profile(trace: Path) -> None:
    """ONNX Runtime's kernel time per op type over the profiled runs (bench/ort_profile.py's reading)."""
    from ort_profile import by_op

    totals, counted = by_op(trace, 0)
    total = sum(totals.values())
    print(f"vision.onnx kernels, {counted} runs: {total / max(counted, 1) / 1e6:.2f} s per run")
    for op, us in sorted(totals.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {op:<28} {us / max(counted, 1) / 1e6:8.3f} s {100 * us / max(total, 1e-9):5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smolvlm", "qwen2_5_vl"), default="smolvlm")
    ap.add_argument("--depth-frac", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/decodert-vision-bench"))
    ap.add_argument("--no-torch", action="store_true", help="decodert only (no transformers tower)")
    ap.add_argument("--rebuild-graph", action="store_true", help="write the artifact's vision.onnx again with this "
                    "checkout's export code first (same weights)")
    ap.add_argument("--also-graph", action="append", default=[], help="another vision graph file in the artifact "
                    "folder to time alternately on the same feed (e.g. a copy of vision.onnx before a change)")
    ap.add_argument("--profile", action="store_true", help="ONNX Runtime's profile of vision.onnx, by op type")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["DECODERT_THREADS"] = str(args.threads)
    art, peer = artifact(args)
    if args.rebuild_graph:
        rebuild_graph(art)
    r = measure(art, peer, args.threads, args.repeats, not args.no_torch, args.also_graph,
                args.work if args.profile else None)
    line = (f"{args.model}{'' if args.model == 'smolvlm' else f' x{args.depth_frac:g} depth'}: "
            f"{r['image_tokens']} image tokens, {r['gflop']:.0f} GFLOP; fp32 GEMM {r['gemm_gflops']:.0f} GFLOP/s "
            f"-> floor {r['floor_s']:.2f} s | preprocess {r['preprocess_s'] * 1000:.0f} ms | decodert vision.onnx "
            f"{r['decodert_s']:.2f} s ({r['decodert_floor_fraction']:.0%} of floor)")
    if "torch_s" in r:
        line += (f" | torch tower {r['torch_s']:.2f} s ({r['torch_floor_fraction']:.0%}) | decodert/torch "
                 f"{r['decodert_s'] / r['torch_s']:.2f}x | max |diff| {r['max_abs_diff']:.2e} of {r['max_abs_ref']:.2f}")
    for name in [k[:-2] for k in r if k.startswith("decodert[") and k.endswith("_s")]:
        line += (f" | {name} {r[name + '_s']:.2f} s ({r[name + '_floor_fraction']:.0%}), max |diff| "
                 f"{r[name + '_max_abs_diff']:.1e}")
    print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "repeats": args.repeats,
                                         "depth_frac": args.depth_frac, **r}, indent=2))


if __name__ == "__main__":
    main()
