"""transformers' own Qwen2-VL / Qwen3-VL video processor steps, run without torchvision (test-only helper).

transformers' video processor modules import torchvision at the top, and torchvision has no CPU build for this
torch in the package index here, so the classes cannot be instantiated. Their ``smart_resize``, ``sample_frames``
and ``patchify`` are taken from the installed source files and run as they are; what stays of the class is
torchvision's tensor resize, written here as torchvision does it (float bicubic with antialias through
torch.nn.functional.interpolate, clamped and rounded back to uint8), and transformers' fused rescale +
normalise ((x - mean / rescale) / (std / rescale) in float32). ``ReferenceVideoProcessor`` plugs into
Qwen2_5_VLProcessor / Qwen3VLProcessor as their video processor, so the prompt text (token counts, Qwen3-VL's
timestamps) and Qwen2.5-VL's second_per_grid_ts are theirs.
"""

from __future__ import annotations

import ast
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np


def _transformers_functions(module: str, names: dict[str, str]) -> dict[str, Any]:
    """``names``: {"smart_resize": "", "sample_frames": "ClassName", ...} -> the functions, compiled from the file."""
    import torch
    import transformers

    path = Path(transformers.__file__).parent / module
    tree = ast.parse(path.read_text())
    found: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and names.get(node.name) == "":
            found.append(node)
        if isinstance(node, ast.ClassDef):
            found += [f for f in node.body if isinstance(f, ast.FunctionDef) and names.get(f.name) == node.name]
    for f in found:
        f.decorator_list, f.returns = [], None
        for a in f.args.args + f.args.kwonlyargs:
            a.annotation = None
    assert sorted(f.name for f in found) == sorted(names), (module, [f.name for f in found])
    space: dict[str, Any] = {"math": math, "np": np, "torch": torch, "logger": _Logger()}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), space)  # noqa: S102
    return {n: space[n] for n in names}


class _Logger:
    def warning_once(self, *args: Any) -> None:
        logging.getLogger("transformers").debug(*args)


class ReferenceVideoProcessor:
    """Qwen2VLVideoProcessor (``kind`` "qwen2_5_vl") or Qwen3VLVideoProcessor ("qwen3_vl") with ``settings``
    (the keys of a video_preprocessor_config.json)."""

    def __init__(self, kind: str, settings: dict) -> None:
        qwen3 = kind == "qwen3_vl"
        module = "models/qwen3_vl/video_processing_qwen3_vl.py" if qwen3 else "models/qwen2_vl/video_processing_qwen2_vl.py"
        cls = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
        self.fns = _transformers_functions(module, {"smart_resize": "", "sample_frames": cls, "patchify": cls})
        self.qwen3 = qwen3
        s = dict(settings)
        size = dict(s.pop("size", {}))
        if not qwen3:
            size["shortest_edge"] = s.pop("min_pixels", size.get("shortest_edge"))
            size["longest_edge"] = s.pop("max_pixels", size.get("longest_edge"))
        self.size = size
        self.__dict__.update(s)

    def __call__(self, videos: list, video_metadata: list | None = None, **kwargs: Any) -> Any:
        import torch
        from transformers import BatchFeature
        from transformers.video_utils import VideoMetadata

        pixels, grids, metas = [], [], []
        for k, video in enumerate(videos):
            video = np.asarray(video)
            meta = VideoMetadata(**{"total_num_frames": len(video), "fps": None, "frames_indices": list(range(len(video))),
                                    **(video_metadata[k] if video_metadata else {})})
            if self.do_sample_frames:
                keep = self.fns["sample_frames"](self, meta) if self.qwen3 else \
                    self.fns["sample_frames"](self, meta, fps=self.fps)
                keep = np.asarray(keep)
                meta.frames_indices = keep
                video = video[keep]
            x = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2)  # [T, C, H, W] uint8
            factor = self.patch_size * self.merge_size
            h, w = x.shape[-2:]
            if self.qwen3:
                h, w = self.fns["smart_resize"](len(x), h, w, self.temporal_patch_size, factor,
                                                self.size["shortest_edge"], self.size["longest_edge"])
            else:
                h, w = self.fns["smart_resize"](h, w, factor, self.size["shortest_edge"], self.size["longest_edge"])
            if (h, w) != tuple(x.shape[-2:]):  # torchvision's resize of a uint8 tensor on the CPU, bicubic: native uint8
                x = torch.nn.functional.interpolate(x, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            x = (x.float() - mean[:, None, None]) / std[:, None, None]
            patches, gt, gh, gw = self.fns["patchify"](self, x[None], self.patch_size, self.merge_size,
                                                       self.temporal_patch_size)
            pixels.append(patches[0])
            grids.append([gt, gh, gw])
            metas.append(meta)
        return BatchFeature({"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids),
                             "video_metadata": metas})


# ---- what the video tests of several files share ----------------------------------------------------------------
def clip(rng, t, h, w):
    """A random uint8 clip [t, h, w, 3]."""
    return rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def video_part(frames, fps=None):
    """A chat message's video part (``fps``: the frames' rate, when known)."""
    return {"type": "video", "video": frames, **({"fps": fps} if fps else {})}


def reference(proc, text, videos, images=()):
    """transformers' processor over the same frames, told their rate as transformers' VideoMetadata."""
    from PIL import Image

    meta = [{"total_num_frames": len(v), "fps": fps, "frames_indices": list(range(len(v)))} for v, fps in videos]
    out = proc(text=text, videos=[v for v, _ in videos], video_metadata=meta,
               images=[Image.fromarray(i) for i in images] or None, return_tensors="pt")
    out.pop("video_metadata", None)
    return out


def reference_tokens(model, ref, n=8):
    """transformers' greedy tokens for the processor output ``ref``."""
    import torch

    model.model.rope_deltas = None
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, do_sample=False)
    return out[0, ref["input_ids"].shape[1]:].tolist()


def rope_index(model, ref):
    """transformers' get_rope_index over the processor output ``ref``: (positions [3, 1, S], rope delta)."""
    import torch

    types = torch.zeros_like(ref["input_ids"], dtype=torch.int)
    types[ref["input_ids"] == model.config.image_token_id] = 1
    types[ref["input_ids"] == model.config.video_token_id] = 2
    extra = {"second_per_grid_ts": ref["second_per_grid_ts"]} if "second_per_grid_ts" in ref else {}
    return model.model.get_rope_index(ref["input_ids"], types, image_grid_thw=ref.get("image_grid_thw"),
                                      video_grid_thw=ref["video_grid_thw"], **extra)
