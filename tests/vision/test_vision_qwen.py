"""Qwen2.5-VL against transformers running the model's own processor, on a tiny random checkpoint: placeholder
ids, pixels, vision embeddings, M-RoPE positions, logits, greedy tokens, batches, chunks, sessions, targets."""

from __future__ import annotations

import numpy as np
import pytest

from parity import check_verify_after_prefill
from seeds import rng_for
from tiny_qwen_vl import (
    SIZES, ask, check_batch_equals_singles, check_chunked_prefill, check_follow_up, check_greedy_tokens,
    make_tiny_qwen_vl, random_image, reference_inputs, reference_processor,
)

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

# (height, width): rounded to 16 px, upscaled to min_pixels, several 2x2-unit windows, scaled down to max_pixels


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qvl(request, tmp_path_factory):
    import transformers

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = make_tiny_qwen_vl(root / "hf", seed=int(rng_for(request).integers(1000)), kind=kind)
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    Model = transformers.Qwen3VLForConditionalGeneration if kind == "qwen3_vl" else \
        transformers.Qwen2_5_VLForConditionalGeneration
    model = Model.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf, kind)
    llm.close()


def test_placeholders_pixels_and_embeddings_match_the_processor(qvl, rng):
    from decodert.runtime.vision import qwen_preprocess as qp
    from decodert.runtime.vision.tokens import pixel_digest, text_ids

    llm, model, proc = qvl
    for h, w in SIZES:
        img = random_image(rng, h, w)
        _, text, ids = llm.prepare(ask(img), chat=True).rendered
        ref = reference_inputs(proc, text, [img])
        assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy()), (h, w)
        p = qp.preprocess(img, llm.vision.settings, llm.vision.spec)
        units = p.pixels.reshape(len(p.restore), -1)[p.restore].reshape(p.pixels.shape)  # back to image order
        np.testing.assert_allclose(units, ref["pixel_values"].numpy(), atol=1e-6)
        assert [1, 2 * p.rows, 2 * p.cols] == ref["image_grid_thw"][0].tolist()
        with torch.no_grad():
            out = model.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
        feats = out.pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        entry = llm.vision.store.get(pixel_digest(img))
        np.testing.assert_allclose(entry.embeds, feats.numpy(), atol=1e-4, rtol=1e-4)
        if llm.vision.spec.deepstack:  # Qwen3-VL: the features its first text layers add
            deep = np.stack([torch.cat(list(f)).numpy() if isinstance(f, (list, tuple)) else f.numpy()
                             for f in out.deepstack_features])
            np.testing.assert_allclose(entry.extra["deepstack_embeds"], deep, atol=1e-4, rtol=1e-4)


def test_mrope_positions_equal_get_rope_index(qvl, rng):
    """Two images and a second turn: the positions the runtime derives from the ids are transformers' exactly."""
    from decodert.runtime.vision import mrope

    llm, model, proc = qvl
    imgs = [random_image(rng, 100, 160), random_image(rng, 120, 300)]
    msgs = ask(*imgs) + [{"role": "assistant", "content": "A fox."}, {"role": "user", "content": "And?"}]
    _, text, ids = llm.prepare(msgs, chat=True).rendered
    ref = reference_inputs(proc, text, imgs)
    token_types = (ref["input_ids"] == model.config.image_token_id).int()
    want, delta = model.model.get_rope_index(ref["input_ids"], token_types, ref["image_grid_thw"])
    got, after = mrope.positions(ids, llm.vision.store.locate)
    assert np.array_equal(got, want[:, 0].numpy())
    assert after - len(ids) == int(delta[0, 0]) == mrope.next_offset(ids, llm.vision.store.locate) < 0
    cut = len(ids) // 3  # any split gives the same offsets (a chunk, a reused prefix)
    assert np.array_equal(mrope.offsets(ids[:cut], ids[cut:], llm.vision.store.locate),
                          got[:, cut:] - np.arange(cut, len(ids)))


def test_prefill_and_decode_logits_equal_transformers(qvl, rng):
    llm, model, proc = qvl
    img = random_image(rng, 100, 160)
    _, text, ids = llm.prepare(ask(img), chat=True).rendered
    ref = reference_inputs(proc, text, [img])
    backend = llm.backend
    cache = backend.allocate(1)
    first = backend.prefill(cache, [0], [ids], True)
    nxt = np.array([int(first.next_token[0])], np.int64)
    second = backend.decode(cache, [0], nxt, True)
    with torch.no_grad():
        out = model(**ref)
        full = {**ref, "input_ids": torch.cat([ref["input_ids"], torch.tensor([[int(nxt[0])]])], 1),
                "attention_mask": torch.ones(1, ref["input_ids"].shape[1] + 1, dtype=torch.long),
                "mm_token_type_ids": torch.cat([ref["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int)], 1)}
        model.model.rope_deltas = None
        out2 = model(**full)
    np.testing.assert_allclose(first.logits[0], out.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(second.logits[0], out2.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)


def test_a_verify_pass_after_an_image_equals_decode_steps(qvl, rng):
    """Speculative decoding's verify pass binds the rows' M-RoPE offsets as prefill and decode do."""
    llm, _, _ = qvl
    img = random_image(rng, 100, 160)
    _, _, ids = llm.prepare(ask(img), chat=True).rendered
    check_verify_after_prefill(llm.backend, ids)


def test_greedy_tokens_equal_transformers(qvl, rng):
    check_greedy_tokens(*qvl, rng)


def test_a_batch_equals_the_singles(qvl, rng):
    check_batch_equals_singles(qvl[0], rng)


def test_a_chunked_prefill_through_an_image_equals_one_call(qvl, rng):
    check_chunked_prefill(qvl[0], rng)


def test_a_follow_up_prefills_only_the_new_turn_and_equals_a_full_prefill(qvl, rng):
    check_follow_up(qvl[0], rng)


@pytest.mark.parametrize("target", ["portable", "trt"])
def test_other_targets_turn_the_same_positions(qvl, tmp_path, target, rng):
    if target == "trt" and qvl[0].vision.spec.deepstack:
        pytest.skip("one model is enough for the trt graph's rotation; the portable one checks deepstack's scatter")
    """The standard-op rotation (portable) and RotaryEmbedding-23 without position ids (the trt graphs, run by
    ONNX Runtime here) give the ort target's tokens."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    llm, _, _ = qvl
    export_model(llm.manifest.source.path, tmp_path / target, target=target, dtype="fp32", max_seq=512,
                 progress=False, **({"plugins": "never"} if target == "trt" else {}))
    img = random_image(rng, 100, 160)
    with LLM.load(tmp_path / target, backend="ort") as other:
        assert other.chat(ask(img), max_new_tokens=6, temperature=0).token_ids == \
            llm.chat(ask(img), max_new_tokens=6, temperature=0).token_ids


def test_the_ort_vision_graph_attends_window_by_window(qvl):
    """ort: MultiHeadAttention in every layer, the windowed layers over [W, S] window slots (no [P, P] mask); the
    trt graph (no data-dependent shapes) keeps the mask: test_qwen_vision_graph_builds_with_tensorrt_rtx..."""
    import onnx

    from decodert.export.lowering.vision_qwen import build_qwen_vision
    from decodert.export.lowering.lower_trt import TrtLowering

    llm, _, _ = qvl
    graph = onnx.load(str(llm.backend.dir / "vision.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    spec = llm.vision.spec
    assert ops.count("MultiHeadAttention") == spec.num_layers and "Softmax" not in ops
    windowed = bool(spec.window_size)
    assert any("/windows/" in n.name for n in graph.node) == windowed
    assert not any("window_mask" in n.name for n in graph.node)
    weights = {t.name: t for t in graph.initializer if t.name.startswith("vision.")}
    trt = build_qwen_vision(spec, "fp32", weights, low=TrtLowering).graph
    assert any("window_mask" in n.name for n in trt.node) == windowed
    assert not any("/windows/" in n.name for n in trt.node)


def test_spec_and_settings_from_the_checkpoint(qvl):
    llm, _, _ = qvl
    spec = llm.manifest.model.spec()
    assert spec.mrope.section == (2, 3, 3) and spec.images.token_id == llm.vision.image_token_id
    if spec.family == "qwen3_vl":
        assert spec.mrope.interleaved and spec.attention.qk_norm and spec.images.deepstack_layers == 2
        assert llm.vision.spec.tower == "qwen3_vit" and llm.vision.spec.deepstack == (0, 1)
    else:
        assert llm.vision.spec.tower == "qwen_vit" and llm.vision.spec.full_layers == (1,)
    assert (llm.vision.settings["min_pixels"], llm.vision.settings["max_pixels"]) == (32 * 32, 128 * 128)
    import onnx

    graph = onnx.load(str(llm.backend.dir / "prefill.onnx"), load_external_data=False).graph
    assert "MRotaryEmbedding" in {n.op_type for n in graph.node}  # ort: the fused M-RoPE on q and k
    from decodert.export.artifact.inspect import inspect_artifact

    assert "1024..16384 pixels" in inspect_artifact(llm.backend.dir)  # decodert inspect


def test_mrope_reference_and_pair_axes(rng):
    from decodert.plugins.ops.mrope import axis_of_pairs, mrope_ref

    assert axis_of_pairs((2, 3, 3), False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert axis_of_pairs((3, 3, 2), True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # Qwen3-VL's interleaving
    cos, sin = rng.standard_normal((2, 50, 8))
    pos = rng.integers(0, 50, (3, 2, 5))
    c, _ = mrope_ref(pos, cos, sin, (2, 3, 3))
    assert c[1, 4, 0] == cos[pos[0, 1, 4], 0] and c[1, 4, 3] == cos[pos[1, 1, 4], 3] and c[1, 4, 7] == cos[pos[2, 1, 4], 7]


@pytest.mark.trt
def test_qwen_vision_graph_builds_with_tensorrt_rtx_over_patch_rows(qvl, tmp_path):
    """vision.onnx of the Qwen towers parses and builds with TensorRT-RTX, its profile over patch rows (4 .. the
    largest image's: max_pixels 128*128 = 256 patches of 8 px); the trt text graphs (M-RoPE tables) build too."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = qvl
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False,
                 plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    profile = engines["vision"].profile["pixel_values"]
    assert profile["min"] == [4, 3 * 2 * 8 * 8] and profile["max"] == [256, 3 * 2 * 8 * 8]
    outputs = [t["name"] for t in engines["vision"].io["outputs"]]
    assert outputs == (["image_embeds", "deepstack_embeds"] if llm.vision.spec.deepstack else ["image_embeds"])


def test_server_answers_a_data_url_like_the_api(qvl, rng):
    """The server's OpenAI image_url parts reach the Qwen placeholder and M-RoPE path unchanged."""
    import base64
    import io
    import json
    import urllib.request

    from serve_helpers import running

    llm, _, _ = qvl
    img = random_image(rng, 100, 160)
    expected = llm.chat(ask(img), max_new_tokens=5, temperature=0).text
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    url_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": [
        {"role": "user", "content": [url_part, {"type": "text", "text": "What is in this image?"}]}]}
    with running(llm) as (url, _):
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["choices"][0]["message"]["content"] == expected


def test_an_fp16_artifact_encodes_and_answers_close_to_fp32(qvl, tmp_path, rng):
    """fp16 vision.onnx (rotary and norms in float32 inside, casts around them) and fp16 text graphs run."""
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM
    from decodert.runtime.vision.tokens import pixel_digest

    llm, _, _ = qvl
    export_model(llm.manifest.source.path, tmp_path / "fp16", target="ort", dtype="fp16", max_seq=512, progress=False)
    img = random_image(rng, 100, 160)
    with LLM.load(tmp_path / "fp16", backend="ort") as half:
        half.chat(ask(img), max_new_tokens=2, temperature=0)
        got = half.vision.store.get(pixel_digest(img)).embeds
    assert got.dtype == np.float16
    llm.vision.entry(img)
    want = llm.vision.store.get(pixel_digest(img)).embeds
    np.testing.assert_allclose(got.astype(np.float32), want, atol=5e-3 * float(np.abs(want).max()))


def test_the_prefix_cache_reuses_an_image_and_equals_a_fresh_prefill(qvl, rng):
    """A second request about the same image takes its K/V from the prefix cache (whole blocks, so the prefill
    resumes inside the image); the rest still gets the image's positions and the ones after it (derived from the
    ids the restored row holds)."""
    llm, _, _ = qvl
    if llm.prefix_cache is None:
        pytest.skip("the prefix cache is off")
    img = random_image(rng, 120, 300)
    llm.chat(ask(img, text="What is it?"), max_new_tokens=3, temperature=0)
    again = llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0)
    assert again.metrics.cached_tokens >= 32  # whole blocks: the cut falls inside the image's 72 tokens
    llm.prefix_cache.clear()
    assert llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0).token_ids == again.token_ids
