"""Images on the trt backend (TensorRT and CUDA emulated: tests/trt_emulator.py; the engines' graphs run on ONNX
Runtime): the vision engine encodes, the prefill engine takes the image rows, and the greedy tokens equal the
ort backend's on the same artifact, for SmolVLM (Idefics3) and Gemma 3 (bidirectional image attention)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import trt_emulator  # noqa: E402
from tiny_gemma3_vision import make_tiny_gemma3_vlm  # noqa: E402
from tiny_vision import make_tiny_vlm  # noqa: E402

pytest.importorskip("PIL.Image")
pytest.importorskip("torch")

MAKERS = {"idefics3": make_tiny_vlm, "gemma3": make_tiny_gemma3_vlm}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def artifact(request, tmp_path_factory):
    from decodert.export.pipeline import export_model

    root = tmp_path_factory.mktemp(f"trt-{request.param}")
    hf = MAKERS[request.param](root / "hf", seed=int(np.random.default_rng().integers(1000)))
    out = root / "trt"
    export_model(hf, out, target="trt", dtype="fp32", max_seq=512, max_batch=4, progress=False)
    trt_emulator.emulate_engines(out, scratch={"prefill": 8192, "decode": 4096, "verify": 16384, "vision": 4096})
    return out


@pytest.fixture()
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


def _ask(img, text="What is in this image?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def test_image_prompts_give_the_ort_backends_tokens(artifact, emulator):
    from decodert.runtime.llm import LLM

    _, trt = emulator
    rng = np.random.default_rng()
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((70, 50), (64, 64), (100, 160))]
    asks = [_ask(img) for img in images] + [[{"role": "user", "content": "Hi"}]]
    with LLM.load(artifact, backend="ort") as ref, LLM.load(artifact, backend="trt") as llm:
        assert llm.vision is not None and llm.backend.name == "trt"
        want = [ref.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
        assert [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks] == want
        assert "vision.onnx" in trt.deserialized  # the vision engine ran, not an ORT session
        batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
        assert [r.token_ids for r in batch] == want
        chat = llm.session()
        chat.chat(asks[2][0], max_new_tokens=4, temperature=0)
        follow = chat.chat("And the colour?", max_new_tokens=4, temperature=0)
        assert follow.token_ids == ref.chat(chat.history[:-1], max_new_tokens=4, temperature=0).token_ids
        chat.close()
