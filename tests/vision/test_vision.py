"""Vision-language models (Idefics3 / SmolVLM) against transformers running the model's own processor, on a
tiny random checkpoint: placeholder ids, pixels, vision embeddings, greedy tokens, batches, sessions, the server."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from seeds import rng_for
from tiny_vision import make_tiny_vlm, reference_processor

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

SIZES = [(70, 50), (100, 160), (64, 64), (120, 300)]  # (height, width): split 3x2, 2x3, unsplit, 2x5 tiles


@pytest.fixture(scope="module")
def vlm(request, tmp_path_factory):
    from transformers import Idefics3ForConditionalGeneration

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    root = tmp_path_factory.mktemp("vlm")
    hf = make_tiny_vlm(root / "hf", seed=int(rng_for(request).integers(1000)))
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=4, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    model = Idefics3ForConditionalGeneration.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf)
    llm.close()


def _image(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _ask(img, text="What is in this image?"):
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}]


def _reference_tokens(model, proc, text, images, n=8):
    ref = proc(text=text, images=[Image.fromarray(i) for i in images], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ref, max_new_tokens=n, do_sample=False)
    return out[0, ref["input_ids"].shape[1]:].tolist()


def test_placeholders_pixels_and_embeddings_match_the_processor(vlm, rng):
    from decodert.runtime.vision import preprocess as pre
    from decodert.runtime.vision.tokens import is_image, pixel_digest, text_ids

    llm, model, proc = vlm
    for h, w in SIZES:
        img = _image(rng, h, w)
        _, text, ids = llm.prepare(_ask(img), chat=True).rendered
        ref = proc(text=text, images=[Image.fromarray(img)], return_tensors="pt")
        assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy()), (h, w)
        assert is_image(ids).sum() == (ids == llm.vision.image_token_id).sum() + len(llm.vision.store.get(
            pixel_digest(img)).ids)  # every <image> is an image id
        tiles = pre.preprocess(img, llm.vision.settings)
        np.testing.assert_allclose(tiles.pixels, ref["pixel_values"][0].numpy(), atol=1e-6)
        with torch.no_grad():
            feats = model.model.get_image_features(ref["pixel_values"], ref["pixel_attention_mask"]).pooler_output[0]
        np.testing.assert_allclose(llm.vision.store.get(pixel_digest(img)).embeds, feats.numpy(), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers(vlm, rng):
    llm, model, proc = vlm
    for h, w in SIZES[:3]:
        img = _image(rng, h, w)
        result = llm.chat(_ask(img), max_new_tokens=8, temperature=0)
        _, text, _ = llm.prepare(_ask(img), chat=True).rendered
        assert result.token_ids == _reference_tokens(model, proc, text, [img]), (h, w)
    two = [_image(rng, 90, 60), _image(rng, 64, 64)]  # two images in one message
    msgs = [{"role": "user", "content": [{"type": "image", "image": two[0]}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": Image.fromarray(two[1])}]}]
    _, text, _ = llm.prepare(msgs, chat=True).rendered
    assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == _reference_tokens(model, proc, text, two)


def test_a_batch_equals_the_singles(vlm, rng):
    llm, _, _ = vlm
    asks = [_ask(_image(rng, 70, 50)), _ask(_image(rng, 64, 64), "Hello?"), [{"role": "user", "content": "Hi"}]]
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles


def test_a_chunked_prefill_binds_each_chunks_own_image_rows(vlm, rng):
    llm, model, proc = vlm
    img = _image(rng, 70, 50)  # 200 tokens: chunks of 48 cut through the image tokens
    want = llm.chat(_ask(img), max_new_tokens=6, temperature=0).token_ids
    chunk, llm.backend.prefill_chunk = llm.backend.prefill_chunk, 48
    try:
        if llm.prefix_cache is not None:
            llm.prefix_cache.clear()  # else the first answer's K/V is reused and nothing is chunked
        again = llm.chat(_ask(img), max_new_tokens=6, temperature=0)
        assert again.metrics.cached_tokens == 0 and again.token_ids == want
    finally:
        llm.backend.prefill_chunk = chunk


def test_a_follow_up_prefills_only_the_new_turn_and_equals_a_full_prefill(vlm, rng):
    llm, _, _ = vlm
    img = _image(rng, 100, 160)
    chat = llm.session()
    first = chat.chat({"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What?"}]},
                      max_new_tokens=5, temperature=0)
    second = chat.chat("And the colour?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the image was not prefilled again
    history = chat.history[:-1]
    fresh = llm.chat(history, max_new_tokens=5, temperature=0)
    assert second.token_ids == fresh.token_ids
    other = _image(rng, 100, 160)  # another image of the same size: not the cached one
    swapped = [{**history[0], "content": [{"type": "image", "image": other}, {"type": "text", "text": "What?"}]}]
    _, _, ids_a = llm.prepare(history[:1], chat=True).rendered
    _, _, ids_b = llm.prepare(swapped, chat=True).rendered
    first_image = int(np.flatnonzero(ids_a >= 1 << 62)[0])
    assert np.array_equal(ids_a[:first_image], ids_b[:first_image]) and ids_a[first_image] != ids_b[first_image]
    chat.close()


def _png(img) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (12000, 12000)).save(buf, format="PNG")  # 144 Mpx of zeros: a few hundred KiB compressed
    return buf.getvalue()


def test_server_accepts_a_data_url_and_refuses_bad_images(vlm, rng):
    from serve_helpers import running

    llm, _, _ = vlm
    img = _image(rng, 70, 50)
    expected = llm.chat(_ask(img), max_new_tokens=5, temperature=0).text

    def body(*urls):
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [
            {"type": "text", "text": "What is in this image?"}]
        return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 5, "temperature": 0}

    def data(raw: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(raw).decode()

    with running(llm) as (url, _):
        status, out = _post(url, body(data(_png(img))))
        assert status == 200 and out["choices"][0]["message"]["content"] == expected
        bad = {"undecodable": data(b"not an image at all"), "bomb": data(_bomb()),
               "remote": "http://169.254.169.254/latest/meta-data/"}
        for name, u in bad.items():
            status, out = _post(url, body(u))
            assert status == 400 and "\n" not in out["error"]["message"], (name, out)
        status, out = _post(url, body(*[data(_png(img))] * (llm.image_limits.max_images + 1)))
        assert status == 400 and "too many images" in out["error"]["message"]


def test_responses_api_takes_input_image_parts(vlm, rng):
    """/v1/responses: an input_image part (a data URL) reaches the model as chat's image_url does."""
    from serve_helpers import running

    llm, _, _ = vlm
    img = _image(rng, 100, 160)
    expected = llm.chat(_ask(img), max_new_tokens=5, temperature=0).text
    url_ = "data:image/png;base64," + base64.b64encode(_png(img)).decode()
    body = {"model": "tiny", "max_output_tokens": 5, "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url_}, {"type": "input_text", "text": "What is in this image?"}]}]}
    with running(llm) as (url, _):
        req = urllib.request.Request(url + "/v1/responses", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert out["output"][-1]["content"][0]["text"] == expected


def test_anthropic_messages_take_a_base64_image_block(vlm, rng):
    """/v1/messages (serve/protocols/anthropic.py): an image block with a base64 source reads as the same image."""
    from serve_helpers import running

    llm, _, _ = vlm
    img = _image(rng, 64, 64)
    expected = llm.chat(_ask(img), max_new_tokens=5, temperature=0).text
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(_png(img)).decode()}
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": "What is in this image?"}]
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": blocks}]}
    with running(llm) as (url, _):
        req = urllib.request.Request(url + "/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
    assert "".join(b["text"] for b in out["content"] if b["type"] == "text") == expected


def test_text_only_models_refuse_images(tmp_path):
    from serve_helpers import export_tiny

    from decodert.errors import DecodertError
    from decodert.runtime.llm import LLM

    with LLM.load(export_tiny(tmp_path), backend="ort") as llm:
        with pytest.raises(DecodertError, match="takes no images"):
            llm.chat(_ask(np.zeros((8, 8, 3), np.uint8)))


def test_cli_image_flag_and_repl_image_command(vlm, tmp_path, capsys, rng):
    from decodert.cli import build_parser
    from decodert.cli.chat import chat_loop, user_message
    from decodert.cli.generate import answer

    llm, _, _ = vlm
    img = _image(rng, 70, 50)
    path = tmp_path / "cat.png"
    path.write_bytes(_png(img))
    expected = llm.chat(_ask(img, "Hi"), max_new_tokens=4, temperature=0).text
    args = build_parser().parse_args(["generate", "OUT", "--prompt", "Hi", "--image", str(path), "--json", "--greedy",
                                      "--max-new-tokens", "4"])
    assert answer(llm, "Hi", [user_message("Hi", args.image)], args) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    lines = iter([f"/image {path}", "Hi", "/image nowhere.png"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["chat", "OUT", "--no-stats", "--greedy", "--max-new-tokens", "4"])
    assert chat_loop(llm, args, read=read, out=out, err=err, banner=False) == 0
    assert out.getvalue().strip() == expected.strip()
    assert "will go with the next message" in err.getvalue() and "nowhere.png is not one" in err.getvalue()


def test_portable_target_places_images_the_same(vlm, tmp_path, rng):
    """The flat-token layout ([T, hidden], portable and trt graphs) scatters the image rows the same way; the
    portable vision graph's standard-op attention encodes as the ort one's MultiHeadAttention and FastGelu."""
    import onnx

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM
    from decodert.runtime.vision.tokens import pixel_digest

    llm, _, _ = vlm
    src = llm.manifest.source.path
    export_model(src, tmp_path / "portable", target="portable", dtype="fp32", max_seq=1024, progress=False)
    img = _image(rng, 100, 160)
    with LLM.load(tmp_path / "portable", backend="ort") as other:
        assert other.chat(_ask(img), max_new_tokens=6, temperature=0).token_ids == \
            llm.chat(_ask(img), max_new_tokens=6, temperature=0).token_ids
        np.testing.assert_allclose(other.vision.store.get(pixel_digest(img)).embeds,
                                   llm.vision.store.get(pixel_digest(img)).embeds, atol=1e-5, rtol=1e-5)
    ops = {t: [n.op_type for n in onnx.load(str(d / "vision.onnx"), load_external_data=False).graph.node]
           for t, d in (("ort", llm.backend.dir), ("portable", tmp_path / "portable"))}
    layers = llm.vision.spec.num_layers
    assert ops["ort"].count("MultiHeadAttention") == ops["ort"].count("FastGelu") == layers
    assert "Softmax" not in ops["ort"] and ops["portable"].count("Softmax") == layers
    assert not {n for n in ops["portable"] if n in ("MultiHeadAttention", "FastGelu")}


@pytest.mark.trt
def test_vision_graph_builds_with_tensorrt_rtx_under_its_own_profile(vlm, tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    llm, _, _ = vlm
    out = tmp_path / "trt"
    export_model(llm.manifest.source.path, out, target="trt", dtype="fp16", max_seq=256, max_batch=2, progress=False)
    engines = trt_build.build_engines(out, progress=False)
    assert (out / "vision.engine").is_file() and engines["vision"].size > 0
    profile = engines["vision"].profile["pixel_values"]  # 1 .. the tiles of the largest image (3x3 + global)
    assert profile["min"][0] == 1 and profile["max"] == [10, 3, 64, 64]
    assert [t["name"] for t in engines["vision"].io["outputs"]] == ["image_embeds"]


def test_a_pinned_image_outlives_the_store_capacity(vlm, rng):
    from decodert.errors import DecodertError
    from decodert.runtime.vision.encoder import ImageStore

    llm, _, _ = vlm
    img = _image(rng, 64, 64)
    want = llm.chat(_ask(img), max_new_tokens=4, temperature=0).token_ids
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    store, llm.vision.store = llm.vision.store, ImageStore(capacity=1)
    llm.backend.images = llm.vision.store
    try:
        seq = llm.engine.sequence(llm.prepare(_ask(img), chat=True, max_new_tokens=4, temperature=0))
        ids = seq.prompt
        llm.vision.entry(_image(rng, 64, 64))  # another image evicts it from the store's LRU
        assert [r.token_ids for r in llm.run([seq])] == [want]  # the sequence's pin kept its rows
        del seq
        import gc
        gc.collect()
        with pytest.raises(DecodertError, match="no longer in the image store"):
            llm.vision.store.rows(ids)
    finally:
        llm.vision.store = llm.backend.images = store


def test_smolvlm2_checkpoints_run_the_same_way(tmp_path, rng):
    """model_type smolvlm (SmolVLM2): the same tower, connector and text model. transformers' SmolVLMProcessor needs
    num2words (for video), so the reference inputs come from Idefics3Processor, whose image path it shares."""
    from transformers import SmolVLMForConditionalGeneration

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    hf = make_tiny_vlm(tmp_path / "hf", seed=3, kind="smolvlm")
    export_model(hf, tmp_path / "art", target="ort", dtype="fp32", max_seq=1024, progress=False)
    model = SmolVLMForConditionalGeneration.from_pretrained(hf).eval()
    img = _image(rng, 100, 160)
    with LLM.load(tmp_path / "art", backend="ort") as llm:
        _, text, _ = llm.prepare(_ask(img), chat=True).rendered
        got = llm.chat(_ask(img), max_new_tokens=8, temperature=0).token_ids
    assert got == _reference_tokens(model, reference_processor(hf), text, [img])


def test_server_messages_keep_image_parts_and_refuse_other_kinds():
    from decodert.serve.api_error import ApiError
    from decodert.serve.protocols.requests import ChatMessage

    url = {"url": "data:image/png;base64,AAAA"}
    mixed = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                                   {"type": "text", "text": "What?"}]})
    assert mixed.text(0) == [{"type": "image_url", "image_url": url}, {"type": "text", "text": "What?"}]
    odd = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                                 {"type": "file"}]})  # input_audio: tests/audio
    with pytest.raises(ApiError, match="'file'"):
        odd.text(0)
