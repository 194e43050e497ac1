"""Chat messages with image and video parts -> the messages the chat template renders, and the media in order.

Accepted parts: ``{"type": "image", "image": path | bytes | PIL.Image | HxWx3 uint8 array | data URL}``
(the API) and OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
(the server); ``{"type": "video", "video": frames, "fps": optional}`` and
``{"type": "video_url", "video_url": {"url": [frame data URLs]}, "fps": optional}`` (runtime/vision/video.py).
Each becomes ``{"type": "image"}`` / ``{"type": "video"}`` for the template, which writes the model's
placeholder there (runtime/vision/encoder.py expands it). Images come back as arrays, videos as Video.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from decodert.errors import DecodertError
from decodert.runtime.vision.images import DEFAULT_LIMITS, ImageLimits, load_image
from decodert.runtime.vision.video import Video, load_video

IMAGE_PARTS = ("image", "image_url")
VIDEO_PARTS = ("video", "video_url")
PARTS = IMAGE_PARTS + VIDEO_PARTS


def split_images(messages: Any, limits: ImageLimits = DEFAULT_LIMITS,
                 fetch: Any = None) -> tuple[Any, list[np.ndarray | Video]]:
    """(messages with each image / video part replaced by ``{"type": "image"}`` / ``{"type": "video"}``, the
    decoded RGB images and videos in order).
    Messages without image parts come back as they are. ``fetch(url, what) -> bytes``: how remote
    http(s) URLs are read when allowed (None: refused)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return messages, []
    if not any(_has_images(m) for m in messages):
        return messages, []
    out: list = []
    images: list[np.ndarray | Video] = []
    frames = pixels = 0  # over the request's videos
    for i, m in enumerate(messages):
        if not _has_images(m):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(m["content"]):
            if isinstance(part, Mapping) and part.get("type") in VIDEO_PARTS:
                what = f"message {i} video {j}"
                video = load_video(_video_source(part, what), part.get("fps"), what, limits, frames, pixels)
                frames, pixels = frames + len(video.frames), pixels + video.frames[0].size // 3 * len(video.frames)
                images.append(video)
                parts.append({"type": "video"})
            elif isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                what = f"message {i} image {j}"
                if sum(not isinstance(x, Video) for x in images) >= limits.max_images:
                    raise DecodertError(f"too many images: the limit is {limits.max_images} per request")
                images.append(load_image(_source(part, what, fetch), what, limits))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, images


def _has_images(m: Any) -> bool:
    content = m.get("content") if isinstance(m, Mapping) else None
    return isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in PARTS for p in content)


def _source(part: Mapping, what: str, fetch: Any) -> Any:
    if part["type"] == "image":
        if "image" not in part:
            raise DecodertError(f"{what}: an image part needs an 'image' (a path, bytes, a PIL image or an array)")
        return part["image"]
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise DecodertError(f"{what}: image_url needs a 'url' string")
    if url.startswith(("http://", "https://")):
        if fetch is None:
            raise DecodertError(f"{what}: remote image URLs are refused (the server allows them with --allow-image-urls)")
        return fetch(url, what)
    if not url.startswith("data:"):
        raise DecodertError(f"{what}: image_url must be a data: URL (or http(s) where allowed)")
    return url


def _video_source(part: Mapping, what: str) -> Any:
    if part["type"] == "video":
        if "video" not in part:
            raise DecodertError(f"{what}: a video part needs a 'video' (a list of frames or a TxHxWx3 array)")
        return part["video"]
    ref = part.get("video_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if isinstance(url, str):
        raise DecodertError(f"{what}: video files are not decoded; send video_url.url as a list of frame "
                            "image data URLs")
    if not isinstance(url, list) or not all(isinstance(u, str) and u.startswith("data:") for u in url):
        raise DecodertError(f"{what}: video_url needs a 'url' list of frame image data URLs")
    return url
