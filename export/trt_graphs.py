"""What ``decodert build`` builds each engine from: the graph's bytes as TensorRT parses them and the optimization
profile (export/trt_build.py); the graph record of an engine name is artifact/trt_engines.py ``graph_of``.

A vision-language prefill graph's image inputs (image_embeds / image_positions / image_ahead / Qwen3-VL's
deepstack_embeds) have empty defaults, and an M-RoPE model's graphs (prefill, decode, verify) default
rope_offsets to zeros; TensorRT's parser would fold those into constants, so the build parses each graph
without them (artifact/graph_contract.py ENGINE_INPUTS) and the engine takes them: image_tokens 0 .. B*S (the trt backend
binds 0 rows for text), rope_offsets [3, batch, seq] over the graph's own batch and seq ranges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from decodert.artifact.manifest import GraphRecord, Manifest
from decodert.artifact.graph_contract import DEFAULTED_INPUTS, ENGINE_INPUTS


def profile_shapes(graph: GraphRecord, name: str, batch: int, seq: int, tiles: int = 1, patches: int = 4,
                   audio: dict[str, tuple[int, int, int]] | None = None) -> dict[str, tuple[list[int], ...]]:
    """Input name -> (min, opt, max) dims from the manifest's symbolic dims ("batch", "seq", "images",
    "image_tokens", the Qwen-VL towers' "patches": 4 .. the patch rows of the largest image, and audio.onnx's
    chunk, window and token dims: ``audio_ranges``)."""
    opt_batch = batch if name == "decode" else max(batch // 2, 1)
    ranges = {"batch": (1, opt_batch, batch), "seq": (1, min(seq, 256), seq), "images": (1, tiles, tiles),
              "image_tokens": (0, min(seq, 256), batch * seq), "patches": (4, min(1024, patches), patches),
              **(audio or {})}
    if name == "verify":  # speculative decoding: 1 .. max_tokens per row, at every batch size
        width = min(graph.max_tokens or seq, seq)
        ranges = {"batch": (1, batch, batch), "seq": (1, min(width, 8), width)}
    shapes = {}
    for inp in graph.inputs:
        if inp.name in DEFAULTED_INPUTS and inp.name not in ENGINE_INPUTS:  # folded into a constant: no profile
            continue
        dims = [ranges[d] if isinstance(d, str) else (int(d),) * 3 for d in inp.shape]
        shapes[inp.name] = tuple([d[k] for d in dims] for k in range(3))
    return shapes


def audio_ranges(manifest: Manifest, seconds: float = 30.0) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of audio.onnx's dims for clips up to ``seconds`` (runtime/audio/encoder.py encoder_feeds),
    by the encoder kind (``AUDIO_RANGES``)."""
    if manifest.audio is None:
        return {}
    from decodert.models.audio import audio_spec

    a = audio_spec(dict(manifest.audio.spec))
    hop = int(manifest.audio.features.get("hop_length", 160))
    rate = int(manifest.audio.features.get("sampling_rate", 16000))
    return AUDIO_RANGES[a.encoder](a, int(seconds * rate // hop))


def _chunk_ranges(a: Any, frames: int) -> dict[str, tuple[int, int, int]]:
    """qwen3_asr: chunks of 2 n_window frames in windows of n_window_infer frames, 13 rows a chunk."""
    chunks = -(-frames // a.chunk_frames)
    per = min(a.window_chunks, chunks)
    windows = -(-chunks // per)
    k = a.chunk_tokens
    return {"chunks": (1, per, windows * per), "windows": (1, 1, windows), "window_slots": (k, per * k, per * k),
            "audio_tokens": (1, per * k, windows * per * k)}


def _window_ranges(a: Any, frames: int) -> dict[str, tuple[int, int, int]]:
    """whisper: one clip, 2 R of its window's frames for R rows (2 .. max_positions), half as many tokens."""
    rows = min(a.max_positions, -(-frames // 2))
    rows += rows % 2
    return {"clips": (1, 1, 1), "frames": (4, rows, 2 * rows), "rows": (2, rows // 2, rows),
            "audio_tokens": (1, rows // 4, rows // 2)}


def _conformer_ranges(a: Any, frames: int) -> dict[str, tuple[int, int, int]]:
    """gemma4: frames padded to blocks of 4 C (a clip of 30 s: 3000 frames), halved, then C query rows a block."""
    step = a.frame_multiple
    most = -(-frames // step) * step
    opt = max(step, (most // 4) // step * step)
    return {"frames": (step, opt, most), "sub_frames": (step // 2, opt // 2, most // 2),
            "blocks": (1, opt // step, most // step), "audio_tokens": (1, opt // 4, most // 4)}


AUDIO_RANGES = {"qwen3_asr": _chunk_ranges, "whisper": _window_ranges,  # encoder kind (models/audio.py KINDS)
                "gemma4": _conformer_ranges}


def without_input_defaults(path: Path) -> bytes | None:
    """The graph's bytes (external data left where it is) without the default initializers of the inputs an
    engine keeps (ENGINE_INPUTS), or None when it has none."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    kept = [t for t in model.graph.initializer if t.name not in ENGINE_INPUTS]
    if len(kept) == len(model.graph.initializer):
        return None
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model.SerializeToString()


def max_tiles(manifest: Manifest) -> int:
    """The most tiles one image becomes (runtime/vision/preprocess.py): with splitting, the grid of the
    largest resized image plus its global tile; else 1."""
    if manifest.vision is None:
        return 1
    p = manifest.vision.processor
    if not p.get("do_image_splitting"):
        return 1
    side = -(-int(p["size"]["longest_edge"]) // int(p["max_image_size"]["longest_edge"]))  # ceil
    return side * side + 1 if side > 1 else 1


def max_patches(manifest: Manifest) -> int:
    """The most patch rows one image becomes in a Qwen-VL tower (max_pixels / patch^2, whole merge units)."""
    p = manifest.vision.processor if manifest.vision is not None else {}
    if "max_pixels" not in p:
        return 4
    unit = int(p["patch_size"]) * int(p["merge_size"])
    return max(1, int(p["max_pixels"]) // (unit * unit)) * int(p["merge_size"]) ** 2
