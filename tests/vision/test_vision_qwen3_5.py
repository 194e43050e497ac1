"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration): Qwen3-VL's tower without deepstack feeding the hybrid
text model (Gated DeltaNet + gated attention) whose attention layers turn by interleaved M-RoPE on a quarter of
each head. Against transformers running AutoProcessor's choice for qwen3_5 (Qwen3VLProcessor) on a tiny random
checkpoint: placeholder ids, pixels, embeddings, positions, logits, greedy tokens (ort and portable; the trt graphs
run by ONNX Runtime), a batch, chunks, sessions and the prefix cache over the recurrent state; TensorRT-RTX builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity import check_verify_after_prefill
from seeds import rng_for
from tiny_qwen_vl import (
    SIZES, ask, check_batch_equals_singles, check_chunked_prefill, check_follow_up, check_greedy_tokens, fresh,
    make_tiny_qwen_vl, random_image, reference_inputs, reference_processor,
)

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

# (height, width): rounded to 16 px, upscaled to min_pixels, a wide one, scaled down to max_pixels
MAX_SEQ = 512


@pytest.fixture(scope="module")
def q35(request, tmp_path_factory):
    import transformers

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("qwen3_5_vl")
    hf = make_tiny_qwen_vl(root / "hf", seed=int(rng_for(request).integers(1000)), kind="qwen3_5")
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=MAX_SEQ, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf, "qwen3_5")
    llm.close()


def test_spec_declares_the_tower_and_mrope(q35):
    from decodert.models import family_for

    llm, _, _ = q35
    spec = llm.manifest.model.spec()
    assert spec.family == "qwen3_5" and spec.layer_kinds == ("linear_attention", "attention", "linear_attention")
    assert spec.mrope.section == (3, 3, 2) and spec.mrope.interleaved and spec.rope.rotary_dim == 16
    assert spec.images.token_id == llm.vision.image_token_id and spec.images.deepstack_layers == 0
    v = llm.vision.spec
    assert v.tower == "qwen3_vit" and v.deepstack == () and v.num_positions == 36
    assert (llm.vision.settings["min_pixels"], llm.vision.settings["max_pixels"]) == (32 * 32, 128 * 128)
    config = json.loads((Path(llm.manifest.source.path) / "config.json").read_text())
    family = family_for("qwen3_5")
    text_only = family.spec_from_hf({k: v for k, v in config.items() if k != "vision_config"})
    assert text_only.mrope is None and text_only.images is None
    assert family.vision_from_hf({k: v for k, v in config.items() if k != "vision_config"}) is None
    assert family.spec_from_hf({**config["text_config"], "model_type": "qwen3_5_text"}).mrope is None


@pytest.mark.parametrize("change,named", [
    ({"image_token_id": 600}, "image_token_id 600"),
    ({"vision_config": {"out_hidden_size": 48}}, "out_hidden_size 48"),
    ({"text_config": {"rope_parameters": {"mrope_section": [4, 3, 2]}}}, "mrope_section"),
])
def test_a_bad_image_text_config_is_one_line(q35, tmp_path, change, named):
    """An image token outside the vocabulary, a tower whose rows are not text-model wide, M-RoPE sections that do
    not cover the rotary quarter: each refused at export in one line naming it."""
    import shutil

    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model

    llm, _, _ = q35
    src = tmp_path / "bad"
    shutil.copytree(llm.manifest.source.path, src)
    config = json.loads((src / "config.json").read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            for k, v in value.items():
                config[key][k] = {**config[key][k], **v} if isinstance(v, dict) else v
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DecodertError, match=named) as e:
        export_model(src, tmp_path / "out", max_seq=64, progress=False)
    assert "\n" not in str(e.value)


def test_placeholders_pixels_and_embeddings_match_the_processor(q35, rng):
    from decodert.runtime.vision import qwen_preprocess as qp
    from decodert.runtime.vision.tokens import pixel_digest, text_ids

    llm, model, proc = q35
    for h, w in SIZES:
        img = random_image(rng, h, w)
        _, text, ids = llm.prepare(ask(img), chat=True).rendered
        ref = reference_inputs(proc, text, [img])
        assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy()), (h, w)
        p = qp.preprocess(img, llm.vision.settings, llm.vision.spec)
        units = p.pixels.reshape(len(p.restore), -1)[p.restore].reshape(p.pixels.shape)
        np.testing.assert_allclose(units, ref["pixel_values"].numpy(), atol=1e-6)
        assert [1, 2 * p.rows, 2 * p.cols] == ref["image_grid_thw"][0].tolist()
        with torch.no_grad():
            out = model.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
        feats = torch.cat(list(out.pooler_output)).numpy()
        np.testing.assert_allclose(llm.vision.store.get(pixel_digest(img)).embeds, feats, atol=1e-4, rtol=1e-4)


def test_mrope_positions_equal_get_rope_index(q35, rng):
    from decodert.runtime.vision import mrope

    llm, model, proc = q35
    imgs = [random_image(rng, 100, 160), random_image(rng, 120, 300)]
    msgs = ask(*imgs) + [{"role": "assistant", "content": "A fox."}, {"role": "user", "content": "And?"}]
    _, text, ids = llm.prepare(msgs, chat=True).rendered
    ref = reference_inputs(proc, text, imgs)
    want, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"], ref["image_grid_thw"])
    got, after = mrope.positions(ids, llm.vision.store.locate)
    assert np.array_equal(got, want[:, 0].numpy())
    assert after - len(ids) == int(delta[0, 0]) < 0


def test_prefill_and_decode_logits_equal_transformers(q35, rng):
    """With an image (M-RoPE positions) and without one (the multimodal graphs on a text prompt)."""
    llm, model, proc = q35
    img = random_image(rng, 100, 160)
    backend = llm.backend
    for images in ([img], []):
        _, text, ids = llm.prepare(ask(*images), chat=True).rendered
        ref = reference_inputs(proc, text, images) if images else proc(text=text, return_tensors="pt")
        cache = backend.allocate(1)
        first = backend.prefill(cache, [0], [ids], True)
        nxt = np.array([int(first.next_token[0])], np.int64)
        second = backend.decode(cache, [0], nxt, True)
        with torch.no_grad():
            model.model.rope_deltas = None
            out = model(**ref)
            n = ref["input_ids"].shape[1]
            full = {**ref, "input_ids": torch.cat([ref["input_ids"], torch.tensor([[int(nxt[0])]])], 1),
                    "attention_mask": torch.ones(1, n + 1, dtype=torch.long)}
            if "mm_token_type_ids" in ref:
                full["mm_token_type_ids"] = torch.cat([ref["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int)], 1)
            model.model.rope_deltas = None
            out2 = model(**full)
        np.testing.assert_allclose(first.logits[0], out.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(second.logits[0], out2.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers(q35, rng):
    check_greedy_tokens(*q35, rng)


def test_a_batch_equals_the_singles(q35, rng):
    check_batch_equals_singles(q35[0], rng)


def test_a_chunked_prefill_through_an_image_equals_one_call(q35, rng):
    """The conv and recurrent states cross chunk boundaries that cut the image's rows."""
    check_chunked_prefill(q35[0], rng)


def test_a_follow_up_prefills_only_the_new_turn_and_equals_a_full_prefill(q35, rng):
    """The image (and the hybrid's states after it) is not prefilled again."""
    check_follow_up(q35[0], rng)


def test_the_prefix_cache_reuses_an_image_and_equals_a_fresh_prefill(q35, rng):
    """A hybrid resumes only where a state was stored (a block boundary its first prefill stopped at); a second
    question about the same image loads the K/V and the states there, inside the image's tokens."""
    llm, _, _ = q35
    assert llm.prefix_cache is not None
    img = random_image(rng, 120, 300)
    fresh(llm)
    llm.chat(ask(img, text="What is it?"), max_new_tokens=3, temperature=0)
    again = llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0)
    assert again.metrics.cached_tokens >= 32
    fresh(llm)
    assert llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0).token_ids == again.token_ids


def test_a_verify_pass_after_an_image_equals_decode_steps(q35, rng):
    """Speculative decoding's verify pass over a hybrid row (run alone, its states carried) turns the drafted
    tokens by the M-RoPE offsets that follow the image, as decode steps do; a rejection replays accepted tokens
    through prefill, whose offsets the chunked-prefill test checks."""
    llm, _, _ = q35
    check_verify_after_prefill(llm.backend, llm.prepare(ask(random_image(rng, 100, 160)), chat=True).ids)


@pytest.mark.parametrize("target", ["portable", "trt"])
def test_other_targets_give_the_same_tokens(q35, tmp_path, target, rng):
    """The standard-op M-RoPE (portable: per-token tables; trt graphs, run by ONNX Runtime here: RotaryEmbedding-23
    on the rotary quarter) and the Loop-form DeltaNet give the ort target's tokens, for two sizes and two images."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    llm, _, _ = q35
    export_model(llm.manifest.source.path, tmp_path / target, target=target, dtype="fp32", max_seq=MAX_SEQ,
                 max_batch=2, progress=False, **({"plugins": "never"} if target == "trt" else {}))
    asks = [ask(random_image(rng, 100, 160)), ask(random_image(rng, 20, 30), random_image(rng, 64, 64), text="and")]
    with LLM.load(tmp_path / target, backend="ort") as other:
        for msgs in asks:
            fresh(llm)
            assert other.chat(msgs, max_new_tokens=6, temperature=0).token_ids == \
                llm.chat(msgs, max_new_tokens=6, temperature=0).token_ids


@pytest.mark.trt
def test_tensorrt_rtx_builds_the_vision_and_hybrid_text_graphs(q35, tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = q35
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    assert {"vision", "prefill", "decode"} <= set(engines)
    profile = engines["vision"].profile["pixel_values"]
    assert profile["min"] == [4, 3 * 2 * 8 * 8] and profile["max"] == [256, 3 * 2 * 8 * 8]
    assert [t["name"] for t in engines["vision"].io["outputs"]] == ["image_embeds"]


def test_a_video_beside_an_image_equals_transformers(q35, rng):
    """Qwen3.5 takes videos as Qwen3-VL does (Qwen3VLVideoProcessor: sampled at 2 a second, timestamped slices):
    placeholder ids, get_rope_index positions, prefill logits and greedy tokens for a clip beside an image; a
    session's follow-up about it equals a full re-prefill (the hybrid's states after the video kept)."""
    from qwen_video_reference import clip, reference, reference_tokens, rope_index, video_part

    from decodert.runtime.vision import mrope
    from decodert.runtime.vision.tokens import text_ids

    llm, model, proc = q35
    img, frames = random_image(rng, 60, 90), clip(rng, 6, 48, 64)
    msgs = [{"role": "user", "content": [video_part(frames, 2.0), {"type": "image", "image": img},
                                         {"type": "text", "text": "What happens?"}]}]
    _, text, ids = llm.prepare(msgs, chat=True).rendered
    ref = reference(proc, text, [(frames, 2.0)], [img])
    assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy())
    want, delta = rope_index(model, ref)
    got, after = mrope.positions(ids, llm.vision.store.locate)
    assert np.array_equal(got, want[:, 0].numpy()) and after - len(ids) == int(delta[0, 0])
    cache = llm.backend.allocate(1)
    first = llm.backend.prefill(cache, [0], [ids], True)
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model(**ref)
    np.testing.assert_allclose(first.logits[0], out.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)
    fresh(llm)
    assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == reference_tokens(model, ref)
    chat = llm.session()
    one = chat.chat(msgs[0], max_new_tokens=5, temperature=0)
    two = chat.chat("And then?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= one.metrics.prompt_tokens
    fresh(llm)
    assert two.token_ids == llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0).token_ids
    chat.close()


@pytest.fixture(scope="module")
def q35trt(q35, tmp_path_factory):
    """The image-text checkpoint as a trt-target artifact with emulated engines (tests/helpers/trt_emulator.py)."""
    import trt_emulator

    from decodert.export.pipeline import export_model

    art = tmp_path_factory.mktemp("qwen3_5_trt") / "trt"
    export_model(q35[0].manifest.source.path, art, target="trt", dtype="fp32", max_seq=MAX_SEQ, max_batch=4,
                 progress=False, plugins="never")
    trt_emulator.emulate_engines(art, scratch={"prefill": 8192, "decode": 4096, "verify": 16384, "vision": 4096})
    return art


def test_the_trt_backend_answers_images_with_the_ort_tokens(q35trt, monkeypatch, rng):
    """The trt backend (CUDA and TensorRT emulated) over the hybrid with images: rope_offsets reach the prefill,
    decode and verify engines, the DeltaNet/conv states live on the device through KVCache. Against the ort backend
    on the same artifact: several sizes, two images and a text prompt; the batch of them; verify passes after an image
    (rows run alone) and n-gram speculation; a session follow-up; a prefix-cache hit inside an image."""
    import trt_emulator

    from decodert.runtime.llm import LLM

    trt_emulator.install(monkeypatch)
    asks = [ask(random_image(rng, h, w)) for h, w in ((70, 50), (120, 300))]
    asks += [ask(random_image(rng, 90, 60), random_image(rng, 64, 64), text="and"), [{"role": "user", "content": "Hi"}]]
    with LLM.load(q35trt, backend="ort") as ref, LLM.load(q35trt, backend="trt") as llm:
        assert llm.vision is not None and llm.backend.name == "trt"
        want = [ref.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
        assert [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks] == want
        fresh(llm)
        batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
        assert [r.token_ids for r in batch] == want
        check_verify_after_prefill(llm.backend, llm.prepare(asks[1], chat=True).ids)
        fresh(llm)
        plain = llm.chat(asks[0], max_new_tokens=16, temperature=0).token_ids
        fresh(llm)
        assert llm.chat(asks[0], max_new_tokens=16, temperature=0, speculative="ngram").token_ids == plain
        chat = llm.session()
        first = chat.chat(asks[1][0], max_new_tokens=5, temperature=0)
        second = chat.chat("And the colour?", max_new_tokens=5, temperature=0)
        assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens
        assert second.token_ids == ref.chat(chat.history[:-1], max_new_tokens=5, temperature=0).token_ids
        chat.close()
        fresh(llm)
        img = asks[1][0]["content"][0]["image"]
        llm.chat(ask(img, text="What is it?"), max_new_tokens=3, temperature=0)
        again = llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0)
        assert again.metrics.cached_tokens >= 32  # K/V blocks and the states at a boundary inside the image
        assert again.token_ids == ref.chat(ask(img, text="Which colour is it?"), max_new_tokens=6,
                                           temperature=0).token_ids
