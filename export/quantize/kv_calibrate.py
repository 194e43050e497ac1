"""Scales of a quantized KV cache (``--kv-dtype int8|fp8|int4``), calibrated once at export.

The float-cache prefill graph of the model being exported runs over a short built-in text on
ONNX Runtime CPU; its K/V cache then holds every layer's keys (after RoPE) and values. The scales are
**per channel**: one per (layer, K or V, kv head, channel) = the channel's largest magnitude / the
code's largest (127, 448 or 7), stored as ``kv_scale.key.{i}`` / ``kv_scale.value.{i}`` [1, Hkv, 1, D]
float32 initializers of the graphs. A key channel pair (i, i + R/2) that RoPE rotates shares one
scale: the pair's largest norm, which bounds both channels at every position (a rotation keeps the
norm), so positions beyond the calibration text cannot leave the range by rotating. Per channel,
not per tensor: a few key channels are 10-50x larger than the rest (SmolLM2), and one scale per
tensor would leave the small ones a handful of codes. Not dynamic: GroupQueryAttention takes fixed
scales (k_scale / v_scale inputs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from decodert.errors import DecodertError
from decodert.models.spec import ModelSpec, state_specs
from decodert.plugins.ops.kv_dtypes import KVDtype

# Varied prose, code, numbers and a list: about 300 tokens for a 49k-token BPE.
CALIBRATION_TEXT = """The history of the city begins with a small settlement on the river, where traders exchanged
salt, wool and iron. Over the centuries it grew into a busy port; its bridges, markets and churches still
stand today. In 1850 the railway arrived, and with it factories, schools and a new university.
Q: What is the capital of France? A: Paris is the capital and largest city of France.
def mean(values):
    total = sum(values)
    return total / len(values) if values else 0.0
Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Mix, rest for 30 minutes, bake at 180 C.
Dear team, thank you for your hard work this quarter. Revenue grew 12% and customer satisfaction reached 94%.
Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and
release oxygen. The mitochondria then turn sugars into ATP, the energy currency of the cell.
1. Open the settings. 2. Choose "Network". 3. Enter the password and press Connect.
"Where are you going?" she asked. "To the sea," he said, "before the storm comes."
"""
FLOOR = 1e-6  # the smallest scale (a channel that is zero everywhere)


# The scale is the calibrated peak times this: text beyond the calibration reaches past its peak (a
# channel's peak over ~300 tokens is about 2/3 of its peak over 100k), and int8 has codes to spare;
# int4 has not (7 steps), so it clips the rare larger values instead of coarsening every step.
HEADROOM = {"int8": 1.5, "fp8": 1.5, "int4": 1.0}


def calibration_ids(tokenizer_json: Path, max_seq: int) -> list[np.ndarray]:
    """The built-in text's ids in prompts of at most ``max_seq - 1`` tokens (each run on an empty cache)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(CALIBRATION_TEXT).ids
    step = max_seq - 1
    return [np.asarray(ids[i : i + step], np.int64) for i in range(0, len(ids), step)]


def calibrate(graph: Path, spec: ModelSpec, kv: KVDtype, dtype: str, max_seq: int, prompts: list[np.ndarray],
              rotary_dim: int) -> dict[str, np.ndarray]:
    """Run ``graph`` (a float-cache prefill graph) over ``prompts``; scale name -> [1, Hkv, 1, D] float32."""
    import onnxruntime as ort

    if dtype not in ("fp32", "fp16"):
        raise DecodertError(f"--kv-dtype {kv.name} with --dtype {dtype}: the scales are calibrated on ONNX Runtime "
                            "CPU, which has no bf16 kernels; export --dtype fp32 or fp16")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    np_dtype = np.float32 if dtype == "fp32" else np.float16
    past = {i.name: np.zeros([1, spec.num_kv_heads, max_seq, spec.head_dim_of(int(i.name.rsplit(".", 1)[1]))], np_dtype)
            for i in sess.get_inputs() if i.name.startswith(("past_key.", "past_value."))}
    states = {f"past_{st.io_name}" for st in state_specs(spec)}  # a hybrid's conv / recurrent states: zero
    past.update({i.name: np.zeros([1 if isinstance(d, str) or d is None else d for d in i.shape], _NP[i.type])
                 for i in sess.get_inputs() if i.name in states})
    names = [o.name for o in sess.get_outputs() if o.name.startswith(("present_key.", "present_value."))]
    peaks: dict[str, np.ndarray] = {}
    for ids in prompts:
        feeds = {"input_ids": ids[None], "past_lengths": np.zeros(1, np.int64),
                 "seq_lengths": np.array([len(ids)], np.int64), **past}
        for name, cache in zip(names, sess.run(names, feeds)):
            x = np.abs(cache[0, :, : len(ids)].astype(np.float32))  # [Hkv, n, D]
            if name.startswith("present_key"):
                x = _pair_norms(x, rotary_dim)
            peaks[name] = np.maximum(peaks.get(name, 0.0), x.max(axis=1))  # [Hkv, D]
    scales = {}
    for name, peak in peaks.items():
        peak = np.maximum(peak * HEADROOM[kv.name], FLOOR * kv.qmax)
        scales[name.replace("present_", "kv_scale.", 1)] = (peak / kv.qmax).astype(np.float32)[None, :, None, :]
    return scales


_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # a conv / recurrent state's element type


def _pair_norms(keys: np.ndarray, rotary_dim: int) -> np.ndarray:
    """|k| with each rotated pair (i, i + R/2) replaced by the pair's norm (RoPE keeps it at every position)."""
    half = rotary_dim // 2
    out = keys.copy()
    norm = np.sqrt(keys[..., :half] ** 2 + keys[..., half:rotary_dim] ** 2)
    out[..., :half] = norm
    out[..., half:rotary_dim] = norm
    return out


def scale_tensors(scales: dict[str, np.ndarray]) -> dict[str, onnx.TensorProto]:
    """The scales as graph initializers (kept inside the .onnx files: 2 * layers * Hkv * D floats)."""
    return {name: onnx.numpy_helper.from_array(s, name) for name, s in scales.items()}
