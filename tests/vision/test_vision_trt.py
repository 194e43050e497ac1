"""Images on the trt backend (TensorRT and CUDA emulated: tests/helpers/trt_emulator.py; the engines' graphs run on ONNX
Runtime): the vision engine encodes, the prefill engine takes the image rows, and the greedy tokens equal the
ort backend's on the same artifact, for SmolVLM (Idefics3) and Gemma 3 (bidirectional image attention)."""

from __future__ import annotations


import numpy as np
import pytest

import trt_emulator  # noqa: E402
from seeds import rng_for
from tiny_gemma3_vision import make_tiny_gemma3_vlm  # noqa: E402
from tiny_vision import make_tiny_vlm  # noqa: E402

pytest.importorskip("PIL.Image")
pytest.importorskip("torch")

MAKERS = {"idefics3": make_tiny_vlm, "gemma3": make_tiny_gemma3_vlm}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def artifact(request, tmp_path_factory):
    from decodert.export.pipeline import export_model

    root = tmp_path_factory.mktemp(f"trt-{request.param}")
    hf = MAKERS[request.param](root / "hf", seed=int(rng_for(request).integers(1000)))
    out = root / "trt"
    export_model(hf, out, target="trt", dtype="fp32", max_seq=512, max_batch=4, progress=False)
    trt_emulator.emulate_engines(out, scratch={"prefill": 8192, "decode": 4096, "verify": 16384, "vision": 4096})
    return out


@pytest.fixture()
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


def _ask(img, text="What is in this image?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def test_image_prompts_give_the_ort_backends_tokens(artifact, emulator, rng):
    from decodert.runtime.llm import LLM

    _, trt = emulator
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


@pytest.mark.trt
@pytest.mark.parametrize("family", sorted(MAKERS))
def test_engines_take_the_image_inputs_with_tensorrt_rtx(family, tmp_path):
    """TensorRT-RTX (on the CPU) parses and builds the prefill graph with its image inputs (their empty
    defaults dropped, 0 rows allowed for text prompts) and the vision graph under its own profile."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    hf = MAKERS[family](tmp_path / "hf", seed=1)
    out = tmp_path / "trt"
    export_model(hf, out, target="trt", dtype="fp16", max_seq=128, max_batch=2, progress=False)
    engines = trt_build.build_engines(out, progress=False)
    want = ["image_embeds", "image_positions"] + (["image_ahead"] if family == "gemma3" else [])
    assert [t["name"] for t in engines["prefill"].io["inputs"] if t["name"].startswith("image_")] == want
    assert all(engines["prefill"].profile[n]["min"][0] == 0 and engines["prefill"].profile[n]["max"][0] == 256
               for n in want)
    assert "image_embeds" not in engines["decode"].profile
    assert [t["name"] for t in engines["vision"].io["outputs"]] == ["image_embeds"]


def test_prefill_chunks_and_images(artifact, emulator, rng):
    """Chunks shorter than an image: SmolVLM's causal image tokens give the same tokens chunk by chunk; a Gemma 3
    image, whose tokens see each other, must not be cut: a one-line error names the rebuild."""
    from decodert.errors import DecodertError
    from decodert.runtime.llm import LLM

    img = rng.integers(0, 256, (70, 50, 3), dtype=np.uint8)
    with LLM.load(artifact, backend="ort") as ref, LLM.load(artifact, backend="trt") as llm:
        llm.backend.max_prefill = 8  # the host staging was sized for the profile's longer chunks
        if llm.manifest.model.images.bidirectional:
            with pytest.raises(DecodertError, match="spans the prefill engine's 8-token chunk") as e:
                llm.chat(_ask(img), max_new_tokens=4, temperature=0)
            assert "\n" not in str(e.value)
        else:
            assert llm.chat(_ask(img), max_new_tokens=4, temperature=0).token_ids == \
                ref.chat(_ask(img), max_new_tokens=4, temperature=0).token_ids
