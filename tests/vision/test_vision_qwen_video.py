"""Qwen2.5-VL / Qwen3-VL video against transformers running the model's own processor and video processor steps
(tests/helpers/qwen_video_reference.py), on tiny random checkpoints: placeholder ids and grids, pixels, vision embeddings,
M-RoPE positions, logits, greedy tokens (a video alone, and beside an image), a session's follow-up, the server's
video_url parts, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_video_reference import clip, reference, reference_tokens, rope_index, video_part
from seeds import rng_for
from tiny_qwen_vl import make_tiny_qwen_vl, reference_processor

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

# (frames, height, width, fps): every frame (or 4 of 6 sampled, Qwen3-VL at the default 24 fps), an odd count
# (the last frame repeated), frames scaled down to the pixel bound
CLIPS = [(4, 48, 64, 2.0), (6, 70, 50, None), (5, 40, 100, 1.0), (6, 150, 200, 2.0)]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qvl(request, tmp_path_factory):
    import transformers

    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = make_tiny_qwen_vl(root / "hf", seed=int(rng_for(request).integers(1000)), kind=kind)
    export_model(hf, root / "art", target="ort", dtype="fp32", max_seq=1024, max_batch=2, progress=False)
    llm = LLM.load(root / "art", backend="ort")
    Model = transformers.Qwen3VLForConditionalGeneration if kind == "qwen3_vl" else \
        transformers.Qwen2_5_VLForConditionalGeneration
    model = Model.from_pretrained(hf).eval()
    yield llm, model, reference_processor(hf, kind)
    llm.close()


def _ask(*parts, text="What happens?"):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _our_pixels(llm, videos):
    """Our patch rows for ``videos``, back in image order, concatenated as pixel_values_videos."""
    return np.concatenate([np.concatenate([p.pixels.reshape(len(p.restore), -1)[p.restore].reshape(p.pixels.shape)
                                           for p in _slices(llm, v, fps)]) for v, fps in videos])


def _slices(llm, frames, fps):
    from decodert.runtime.vision import qwen_video as qv

    s = llm.vision.video
    return qv.preprocess(frames, qv.timing(len(frames), fps, s).keep, s, llm.vision.spec)


def test_placeholders_pixels_and_embeddings_match_the_processor(qvl, rng):
    from decodert.runtime.vision.tokens import text_ids
    from decodert.runtime.vision.video import Video

    llm, model, proc = qvl
    for t, h, w, fps in CLIPS:
        frames = clip(rng, t, h, w)
        _, text, ids = llm.prepare(_ask(video_part(frames, fps)), chat=True).rendered
        ref = reference(proc, text, [(frames, fps)])
        assert np.array_equal(text_ids(ids), ref["input_ids"][0].numpy()), (t, h, w, fps)
        slices = _slices(llm, frames, fps)
        assert [len(slices), 2 * slices[0].rows, 2 * slices[0].cols] == ref["video_grid_thw"][0].tolist()
        ours = _our_pixels(llm, [(frames, fps)])
        np.testing.assert_allclose(ours, ref["pixel_values_videos"].numpy(), atol=1e-6)  # the uint8 resize is exact
        with torch.no_grad():  # the tower on our rows == transformers' on the same rows (t > 1 grids)
            out = model.model.get_video_features(torch.from_numpy(ours), ref["video_grid_thw"])
        feats = out.pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        entry, _ = llm.vision.video_entry(Video(frames, fps))
        np.testing.assert_allclose(entry.embeds, feats.numpy(), atol=1e-4, rtol=1e-4)
        if llm.vision.spec.deepstack:
            deep = np.stack([torch.cat(list(f)).numpy() if isinstance(f, (list, tuple)) else f.numpy()
                             for f in out.deepstack_features])
            np.testing.assert_allclose(entry.extra["deepstack_embeds"], deep, atol=1e-4, rtol=1e-4)


def test_mrope_positions_equal_get_rope_index(qvl, rng):
    """An image, a video and a second turn: the positions derived from the ids are transformers' exactly; any
    split of the ids gives the same offsets."""
    from decodert.runtime.vision import mrope

    llm, model, proc = qvl
    img, frames = rng.integers(0, 256, (60, 90, 3), dtype=np.uint8), clip(rng, 4, 48, 64)
    msgs = _ask({"type": "image", "image": img}, video_part(frames, 2.0)) + [
        {"role": "assistant", "content": "A fox runs."}, {"role": "user", "content": "And?"}]
    _, text, ids = llm.prepare(msgs, chat=True).rendered
    ref = reference(proc, text, [(frames, 2.0)], [img])
    want, delta = rope_index(model, ref)
    got, after = mrope.positions(ids, llm.vision.store.locate)
    assert np.array_equal(got, want[:, 0].numpy())
    assert after - len(ids) == int(delta[0, 0]) == mrope.next_offset(ids, llm.vision.store.locate)
    for cut in (len(ids) // 3, len(ids) // 2 + 1):
        assert np.array_equal(mrope.offsets(ids[:cut], ids[cut:], llm.vision.store.locate),
                              got[:, cut:] - np.arange(cut, len(ids)))


def test_a_long_clip_continues_text_after_its_last_time_step(qvl, rng):
    """Qwen2.5-VL: slices 4 positions apart (tokens_per_second 1 x 2 frames / 0.5 fps); the video tokens sit where
    get_rope_index puts them and the text after goes on one past the largest (the rope delta transformers decodes
    with; its get_rope_index restarts that text at st + max(rows, cols))."""
    from decodert.runtime.vision import mrope

    llm, model, proc = qvl
    frames = clip(rng, 6, 48, 64)
    _, text, ids = llm.prepare(_ask(video_part(frames, 0.5)), chat=True).rendered
    ref = reference(proc, text, [(frames, 0.5)])
    want = rope_index(model, ref)[0][:, 0].numpy()
    got, after = mrope.positions(ids, llm.vision.store.locate)
    video = np.flatnonzero(ref["input_ids"][0].numpy() == model.config.video_token_id)
    assert np.array_equal(got[:, : video[-1] + 1], want[:, : video[-1] + 1])
    tail = np.arange(len(ids) - video[-1] - 1)
    assert np.array_equal(got[:, video[-1] + 1 :], np.broadcast_to(got[:, video].max() + 1 + tail, (3, len(tail))))
    if not llm.vision.video.get("timestamps"):
        assert got[0, video].max() == got[0, video[0]] + 8 > got[1:, video].max()  # time is the widest axis
        assert want[0, video[-1] + 1] == got[1:, video].max() + 1 < got[0, video[-1] + 1]  # transformers 5: st + 4 < st + 9
    assert after == got[0, -1] + 1 and mrope.next_offset(ids, llm.vision.store.locate) == after - len(ids)


def test_prefill_logits_and_greedy_tokens_equal_transformers(qvl, rng):
    llm, model, proc = qvl
    for t, h, w, fps in [CLIPS[0], CLIPS[1]]:
        frames = clip(rng, t, h, w)
        _, text, ids = llm.prepare(_ask(video_part(frames, fps)), chat=True).rendered
        ref = reference(proc, text, [(frames, fps)])
        cache = llm.backend.allocate(1)
        first = llm.backend.prefill(cache, [0], [ids], True)
        model.model.rope_deltas = None
        with torch.no_grad():
            out = model(**ref)
        np.testing.assert_allclose(first.logits[0], out.logits[0, -1].numpy(), atol=1e-4, rtol=1e-4)
        result = llm.chat(_ask(video_part(frames, fps)), max_new_tokens=8, temperature=0)
        assert result.token_ids == reference_tokens(model, ref), (t, h, w)


def test_images_and_videos_in_one_message_equal_transformers(qvl, rng):
    """A video, an image and another video (frames given as PIL images) in one message."""
    llm, model, proc = qvl
    img, one, two = rng.integers(0, 256, (64, 80, 3), dtype=np.uint8), clip(rng, 6, 40, 56), clip(rng, 4, 32, 48)
    msgs = _ask(video_part(one, 2.0), {"type": "image", "image": img}, video_part([Image.fromarray(f) for f in two], 1.0),
                text="Which comes first?")
    _, text, _ = llm.prepare(msgs, chat=True).rendered
    videos = [(one, 2.0), (two, 1.0)]
    ref = reference(proc, text, videos, [img])
    assert llm.chat(msgs, max_new_tokens=8, temperature=0).token_ids == reference_tokens(model, ref)


def test_a_follow_up_about_the_same_video_equals_a_full_prefill(qvl, rng):
    llm, _, _ = qvl
    frames = clip(rng, 4, 48, 64)
    chat = llm.session()
    first = chat.chat(_ask(video_part(list(frames), 2.0), text="What?")[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And then?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens  # the video was not prefilled again
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    fresh = llm.chat(chat.history[:-1], max_new_tokens=5, temperature=0)
    assert second.token_ids == fresh.token_ids
    chat.close()


def test_a_batch_a_chunked_prefill_and_the_prefix_cache_equal_the_single_answer(qvl, rng):
    """Video rows batched with an image row and a text row, a prefill in chunks of 10 cutting through the slices,
    and a second question taking the video's K/V from the prefix cache all answer as the video alone does."""
    llm, _, _ = qvl
    about_video = _ask(video_part(clip(rng, 6, 48, 64), 2.0), text="What moves?")
    asks = [about_video, _ask({"type": "image", "image": rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)}),
            [{"role": "user", "content": "Hi"}]]
    singles = [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks])
    assert [r.token_ids for r in batch] == singles
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    chunk, llm.backend.prefill_chunk = llm.backend.prefill_chunk, 10
    try:
        assert llm.chat(about_video, max_new_tokens=6, temperature=0).token_ids == singles[0]
    finally:
        llm.backend.prefill_chunk = chunk
    if llm.prefix_cache is not None:
        other = _ask(about_video[0]["content"][0], text="What colour is it?")
        again = llm.chat(other, max_new_tokens=6, temperature=0)
        assert again.metrics.cached_tokens >= 32  # whole blocks of the video's tokens
        llm.prefix_cache.clear()
        assert llm.chat(other, max_new_tokens=6, temperature=0).token_ids == again.token_ids


def test_bad_videos_get_one_line_errors(qvl, tmp_path, rng):
    from decodert.errors import DecodertError
    from decodert.runtime.vision.images import ImageLimits

    llm, _, _ = qvl
    frames = clip(rng, 4, 32, 32)
    bad = {
        "a non-empty list of frames": video_part([]),
        "must share one size": video_part([frames[0], frames[1, :16]]),
        "fps must be a number between 0.001 and 1000": video_part(frames, -1),
        "TxHxWx3 uint8": video_part(frames.astype(np.float32)),
        "could not be decoded": video_part([b"not an image"]),
        "needs a 'video'": {"type": "video"},
        "video files are not decoded": {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    }
    if llm.vision.video.get("sampling") == "qwen3":
        bad["at least 2 frames"] = video_part(frames[:1], 2.0)
    for needle, part in bad.items():
        with pytest.raises(DecodertError, match=needle) as e:
            llm.chat(_ask(part), max_new_tokens=2)
        assert "\n" not in str(e.value)
    limits, llm.image_limits = llm.image_limits, ImageLimits(max_frames=6, max_video_pixels=5 * 32 * 32)
    try:
        with pytest.raises(DecodertError, match="too many video frames"):
            llm.chat(_ask(video_part(frames), video_part(frames)), max_new_tokens=2)
        with pytest.raises(DecodertError, match="pixels in all"):
            llm.chat(_ask(video_part(list(clip(rng, 6, 32, 32)))), max_new_tokens=2)
    finally:
        llm.image_limits = limits


def test_the_server_takes_frames_as_data_urls(qvl, rng):
    """OpenAI-style video_url parts whose url is a list of frame data URLs answer as llm.chat; a video file is a 400."""
    import base64
    import io
    import json
    import urllib.error
    import urllib.request

    from serve_helpers import running

    llm, _, _ = qvl
    frames = clip(rng, 4, 48, 64)
    expected = llm.chat(_ask(video_part(frames, 2.0)), max_new_tokens=5, temperature=0).text
    urls = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())

    def ask(part):
        body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]}
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]

    with running(llm) as (url, _):
        assert ask({"type": "video_url", "video_url": {"url": urls}, "fps": 2.0}) == expected
        with pytest.raises(urllib.error.HTTPError) as e:
            ask({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
        assert e.value.code == 400 and b"video files are not decoded" in e.value.read()


def test_a_model_without_video_refuses_it_in_one_line(tmp_path, rng):
    """Idefics3 (SmolVLM) declares no video processor: a video part is refused; its images still work (Gemma 3's
    artifacts go the same way: no ``video`` in their processor settings)."""
    from tiny_vision import make_tiny_vlm

    from decodert.errors import DecodertError
    from decodert.export.pipeline import export_model
    from decodert.runtime.llm import LLM

    export_model(make_tiny_vlm(tmp_path / "hf"), tmp_path / "art", target="ort", dtype="fp32", max_seq=512,
                 progress=False)
    with LLM.load(tmp_path / "art", backend="ort") as llm:
        assert llm.vision is not None and llm.vision.video is None
        with pytest.raises(DecodertError, match="takes no video") as e:
            llm.chat(_ask(video_part(clip(rng, 4, 32, 32))), max_new_tokens=2)
        assert "\n" not in str(e.value)
        img = {"type": "image", "image": rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)}
        assert llm.chat(_ask(img), max_new_tokens=2, temperature=0).token_ids


def test_cli_video_flag_and_repl_video_command(qvl, tmp_path, capsys, rng):
    import json

    from decodert.cli import build_parser
    from decodert.cli.chat import media, user_message
    from decodert.cli.generate import answer

    llm, _, _ = qvl
    frames = clip(rng, 4, 48, 64)
    folder = tmp_path / "clip"
    folder.mkdir()
    for k, f in enumerate(frames):  # written out of order: read back by name
        Image.fromarray(f).save(folder / f"frame_{k:03d}.png")
    (folder / "notes.txt").write_text("not a frame")
    expected = llm.chat(_ask(video_part(frames, 2.0), text="Hi"), max_new_tokens=4, temperature=0).text
    args = build_parser().parse_args(["generate", "OUT", "--prompt", "Hi", "--video", str(folder), "--video-fps", "2",
                                      "--json", "--greedy", "--max-new-tokens", "4"])
    assert answer(llm, "Hi", [user_message("Hi", media(args))], args) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    files = ",".join(str(folder / f"frame_{k:03d}.png") for k in range(4))
    assert [list(v) for v in media(build_parser().parse_args(["generate", "OUT", "--prompt", "Hi", "--video", files]))] \
        == [sorted(folder.glob("*.png"))]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "OUT", "--prompt", "Hi", "--video", str(tmp_path / "none")])
    assert "is not a frame file or a folder" in capsys.readouterr().err

    import io

    from decodert.cli.chat import chat_loop

    lines = iter([f"/video {folder}", "Hi", "/video nowhere"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["chat", "OUT", "--no-stats", "--greedy", "--max-new-tokens", "4"])
    assert chat_loop(llm, args, read=read, out=out, err=err, banner=False) == 0  # /video DIR in the REPL
    assert out.getvalue().strip() == llm.chat(_ask(video_part(frames), text="Hi"), max_new_tokens=4, temperature=0).text.strip()
    assert "video of 4 frames will go with the next message" in err.getvalue()
    assert "'nowhere' is not a frame file or a folder" in err.getvalue()


def test_the_artifact_records_the_video_processor(qvl):
    """The export resolved the checkpoint's video_preprocessor_config.json over the family's defaults."""
    from decodert.export.artifact.inspect import inspect_artifact

    llm, model, _ = qvl
    video = llm.vision.video
    assert video["video_token_id"] == model.config.video_token_id and video["temporal_patch_size"] == 2
    if video["sampling"] == "qwen3":
        assert video["timestamps"] and video["do_sample_frames"] and video["fps"] == 2
        assert (video["min_pixels"], video["max_pixels"]) == (32 * 32, 6 * 64 * 64)
        assert "2 frames/s sampled" in inspect_artifact(llm.backend.dir)
    else:
        assert not video["timestamps"] and not video["do_sample_frames"] and video["tokens_per_second"] == 1
        assert (video["min_pixels"], video["max_pixels"]) == (32 * 32, 96 * 96)
        assert "every frame" in inspect_artifact(llm.backend.dir)


@pytest.mark.parametrize("mode,resample", [("bicubic", 3), ("bilinear", 2)])
def test_the_frame_resize_is_torchs_uint8_kernel_exactly(mode, resample, rng):
    """torchvision resizes a uint8 video tensor on the CPU with torch's native antialiased uint8 kernel (bicubic;
    bilinear on AVX2 / arm64): runtime/vision/qwen_video.py's numpy version gives the same bytes, down and up."""
    from decodert.runtime.vision.qwen_video import resize

    for h, w, H, W in [(70, 50, 64, 48), (333, 517, 112, 176), (20, 30, 48, 64), (7, 9, 32, 32), (600, 40, 224, 28)]:
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        x = torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous()
        want = torch.nn.functional.interpolate(x, size=[H, W], mode=mode, align_corners=False, antialias=True)
        assert np.array_equal(resize(frame, H, W, resample), want[0].permute(1, 2, 0).numpy()), (h, w, H, W)
