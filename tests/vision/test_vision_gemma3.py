"""Gemma 3 vision against transformers running the model's own processor, on a tiny random checkpoint:
placeholder ids, pixels, vision embeddings, logits and greedy tokens (ort and portable), the bidirectional
attention among an image's tokens, batches, sessions, and what is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from seeds import rng_for
from tiny_gemma3_vision import make_tiny_gemma3_vlm, reference_processor

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

SIZES = [(50, 70), (64, 64), (120, 30), (200, 180)]  # (height, width): every one resized to the 64 px tile


@pytest.fixture(scope="module")
def g3(request, tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("g3")
    hf = make_tiny_gemma3_vlm(root / "hf", seed=int(rng_for(request).integers(1000)))
    llms = {}
    for target in ("ort", "portable"):
        export_model(hf, root / target, target=target, dtype="fp32", max_seq=256, max_batch=4, progress=False)
        llms[target] = LLM.load(root / target, backend="ort")
    model = Gemma3ForConditionalGeneration.from_pretrained(hf).eval()
    yield llms, model, reference_processor(hf), hf
    for llm in llms.values():
        llm.close()


def _image(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _ask(img, text="What is in this image?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def _reference(model, proc, text, images, n=8):
    """transformers' greedy tokens and last-position logits (with the processor's token_type_ids: the
    bidirectional image mask)."""
    ref = proc(text=text, images=[Image.fromarray(i) for i in images], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, do_sample=False)
        logits = model(**ref).logits[0, -1].numpy()
        causal = model(input_ids=ref["input_ids"], pixel_values=ref["pixel_values"]).logits[0, -1].numpy()
    return out[0, ref["input_ids"].shape[1]:].tolist(), logits, causal


def _last_logits(llm, ids):
    cache = llm.backend.allocate(1)
    return llm.backend.prefill(cache, [0], [ids], True).logits[0]


def test_placeholders_pixels_and_embeddings_match_the_processor(g3, rng):
    from decodert.runtime.vision import gemma3 as pre
    from decodert.runtime.vision.tokens import is_image, pixel_digest, text_ids

    llms, model, proc, _ = g3
    llm = llms["ort"]
    for h, w in SIZES:
        img = _image(rng, h, w)
        _, text, ids = llm.prepare(_ask(img), chat=True).rendered
        ref = proc(text=text, images=[Image.fromarray(img)], return_tensors="pt")
        assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy()), (h, w)
        assert np.array_equal(is_image(ids), ref["token_type_ids"][0].numpy() == 1)  # the image ids are its tokens
        np.testing.assert_allclose(pre.preprocess(img, llm.vision.settings).pixels, ref["pixel_values"].numpy(),
                                   atol=1e-6)
        with torch.no_grad():
            feats = model.model.get_image_features(ref["pixel_values"]).pooler_output[0]
        np.testing.assert_allclose(llm.vision.store.get(pixel_digest(img)).embeds, feats.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_logits_and_greedy_tokens_equal_transformers(g3, target, rng):
    """Several sizes, then two images in one message; the image attends both ways (the sliding window, 8,
    is shorter than an image's 16 tokens), which a causal-only reference would not match."""
    llms, model, proc, _ = g3
    llm = llms[target]
    for h, w in SIZES[:3]:
        img = _image(rng, h, w)
        _, text, ids = llm.prepare(_ask(img), chat=True).rendered
        tokens, logits, causal = _reference(model, proc, text, [img])
        mine = _last_logits(llm, ids)
        np.testing.assert_allclose(mine, logits, atol=1e-4)
        assert np.abs(mine - causal).max() > 1e-2  # the bidirectional mask matters here
        assert llm.chat(_ask(img), max_new_tokens=8, temperature=0).token_ids == tokens, (h, w)
    two = [_image(rng, 90, 60), _image(rng, 64, 64)]
    msgs = [{"role": "user", "content": [{"type": "image", "image": two[0]}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": Image.fromarray(two[1])}]}]
    _, text, _ = llm.prepare(msgs, chat=True).rendered
    assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == _reference(model, proc, text, two)[0]


def test_a_batch_equals_the_singles_and_image_prompts_are_not_chunked(g3, rng):
    llm = g3[0]["ort"]
    asks = [_ask(_image(rng, 70, 50)), _ask(_image(rng, 64, 64), "Hello?"), [{"role": "user", "content": "Hi"}]]
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles
    chunk, llm.backend.prefill_chunk = llm.backend.prefill_chunk, 12  # would cut through the 16 image tokens
    try:
        if llm.prefix_cache is not None:
            llm.prefix_cache.clear()
        again = llm.chat(asks[0], max_new_tokens=6, temperature=0)
        assert again.metrics.cached_tokens == 0 and again.token_ids == singles[0]
    finally:
        llm.backend.prefill_chunk = chunk


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_a_follow_up_about_the_image_equals_a_full_prefill(g3, target, rng):
    llm = g3[0][target]
    img = _image(rng, 100, 160)
    chat = llm.session()
    first = chat.chat(_ask(img, "What?")[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And the colour?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the image was not prefilled again
    fresh = llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0)
    assert second.token_ids == fresh.token_ids
    chat.close()


def test_inspect_names_the_tower_and_its_pooling(g3):
    from decodert.export.artifact.inspect import inspect_artifact

    llm = g3[0]["ort"]
    assert "avg_pool 2 -> 16 tokens a tile; resize to 64x64" in inspect_artifact(llm.backend.dir)


def test_pan_and_scan_and_mismatched_settings_are_refused(g3, tmp_path):
    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model

    hf = tmp_path / "hf"
    shutil.copytree(g3[3], hf)
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    for change, match in (({"do_pan_and_scan": True}, "do_pan_and_scan is not supported"),
                          ({"size": {"height": 32, "width": 32}}, "differs from the vision tower's image_size")):
        (hf / "preprocessor_config.json").write_text(json.dumps({**pre, **change}))
        with pytest.raises(DecodertError, match=match) as e:
            export_model(hf, tmp_path / "out", target="ort", dtype="fp32", max_seq=64, progress=False)
        assert "\n" not in str(e.value)
