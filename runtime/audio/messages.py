"""Chat messages with audio parts -> the messages the chat template renders, and the clips in order.

Accepted parts: OpenAI's ``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`` (the server,
and the API) and ``{"type": "audio", "audio": path | bytes | (samples, sample_rate) | array, "sample_rate": rate}``
(the API; transformers' ``{"type": "audio", "path": ...}`` too). Each becomes ``{"type": "audio", "audio": None}`` for
the template (the key too: Qwen2-Audio's template tests ``'audio' in content``), which writes the model's placeholder
there (runtime/audio/encoder.py expands it). Clips come back as float32 samples at the model's rate
(runtime/audio/clips.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.audio.clips import FORMATS, AudioLimits, load_audio

PARTS = ("audio", "input_audio")


def has_audio(messages: Any) -> bool:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return False
    return any(_has_audio(m) for m in messages)


def split_audio(messages: Any, limits: AudioLimits, rate: int) -> tuple[Any, list[np.ndarray]]:
    """(messages with each audio part replaced by ``{"type": "audio", "audio": None}``, the clips at ``rate`` Hz in order).
    Messages without audio parts come back as they are."""
    if not has_audio(messages):
        return messages, []
    out: list = []
    clips: list[np.ndarray] = []
    for i, m in enumerate(messages):
        if not _has_audio(m):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(m["content"]):
            if isinstance(part, Mapping) and part.get("type") in PARTS:
                what = f"message {i} audio {j}"
                if len(clips) >= limits.max_clips:
                    raise DecodertError(f"too many audio clips: the limit is {limits.max_clips} per request")
                source, sample_rate = _source(part, what)
                clips.append(load_audio(source, what, limits, rate, sample_rate))
                parts.append({"type": "audio", "audio": None})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, clips


def _has_audio(m: Any) -> bool:
    content = m.get("content") if isinstance(m, Mapping) else None
    return isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in PARTS for p in content)


def _source(part: Mapping, what: str) -> tuple[Any, int | None]:
    if part["type"] == "audio":
        for key in ("audio", "path"):
            if key in part:
                return part[key], part.get("sample_rate")
        raise DecodertError(f"{what}: an audio part needs an 'audio' (a path, bytes or (samples, sample_rate))")
    ref = part.get("input_audio")
    if not isinstance(ref, Mapping) or not isinstance(ref.get("data"), str):
        raise DecodertError(f"{what}: input_audio needs a 'data' base64 string and a 'format'")
    fmt = ref.get("format", "wav")
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise DecodertError(f"{what}: input_audio format {fmt!r} is not one of {', '.join(FORMATS)}")
    data = ref["data"]
    return (data if data.startswith("data:") else "data:audio/" + fmt.lower() + ";base64," + data), None
