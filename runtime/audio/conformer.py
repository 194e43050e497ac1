"""The feeds of the ``gemma4`` encoder kind's audio.onnx (export/lowering/audio/gemma4.py): a clip's log-mel frames
padded to whole blocks, and its masks, all in numpy.

    feeds = conformer_feeds(mel, valid, spec)        # mel [T, M] (runtime/audio/features_gemma4.py), valid frames

Extra zero frames past the clip change none of its rows: the convolutions read zeros there either way, the
attention masks those keys and the light conv is causal, so the rows transformers computes over its own padding
(to 128 samples) equal these.
"""

from __future__ import annotations

import numpy as np

from decodert.models.audio_conformer import ConformerSpec, halve


def conformer_feeds(mel: np.ndarray, valid: int, a: ConformerSpec) -> dict[str, np.ndarray]:
    """A clip's log-mel [T, M] and its valid frames -> audio.onnx's inputs."""
    step = a.frame_multiple
    frames = max(step, -(-mel.shape[0] // step) * step)
    feats = np.zeros((frames, mel.shape[1]), np.float32)
    feats[:valid] = mel[:valid]
    mask = np.arange(frames) < valid
    sub = mask[::2]  # [F/2]
    rows = sub[::2]  # [N C]
    blocks = rows.size // a.chunk
    q = np.arange(blocks * a.chunk).reshape(blocks, a.chunk, 1)  # query rows
    k = (np.arange(blocks) * a.chunk)[:, None, None] - a.past + np.arange(a.context)[None, None, :]  # key rows
    dist = q - k
    inside = (k >= 0) & (k < rows.size)
    window = ((dist >= 0) & (dist < a.past)) | ((dist < 0) & (-dist < a.context_right))
    key_valid = inside & window & rows[np.clip(k, 0, rows.size - 1)]
    tokens = a.tokens(valid)
    assert tokens == int(rows.sum()) == halve(halve(valid))
    return {"input_features": feats, "sub_valid": sub, "key_valid": key_valid,
            "token_slots": np.arange(tokens, dtype=np.int64)}
