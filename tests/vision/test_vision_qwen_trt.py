"""Qwen2.5-VL and Qwen3-VL images on the trt backend (TensorRT and CUDA emulated: tests/helpers/trt_emulator.py runs the
engines' graphs on ONNX Runtime): the engines take rope_offsets (prefill, decode, verify) and deepstack_embeds
(prefill), the backend binds them by the rule the ort backend uses (runtime/backends/image_feeds.py), and the
vision engine takes the towers' patch inputs. Reference: the ort backend on the same trt-target artifact (itself
compared with transformers in tests/vision/test_vision_qwen.py)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import trt_emulator  # noqa: E402
from parity import check_verify_after_prefill  # noqa: E402
from seeds import rng_for
from tiny_qwen_vl import ask, make_tiny_qwen_vl, random_image  # noqa: E402

pytest.importorskip("PIL.Image")
pytest.importorskip("torch")

KINDS = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=KINDS)
def artifact(request, tmp_path_factory):
    from decodert.export.pipeline import export_model

    root = tmp_path_factory.mktemp(f"trt-{request.param}")
    hf = make_tiny_qwen_vl(root / "hf", seed=int(rng_for(request).integers(1000)), kind=request.param)
    out = root / "trt"
    export_model(hf, out, target="trt", dtype="fp32", max_seq=512, max_batch=4, progress=False, plugins="never")
    trt_emulator.emulate_engines(out, scratch={"prefill": 8192, "decode": 4096, "verify": 16384, "vision": 4096})
    return out


@pytest.fixture()
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


@pytest.fixture()
def pair(artifact, emulator):
    """(ort LLM, trt LLM) on the artifact; the trt one runs on the emulator."""
    from decodert.runtime.llm import LLM

    with LLM.load(artifact, backend="ort") as ref, LLM.load(artifact, backend="trt") as llm:
        assert llm.vision is not None and llm.backend.name == "trt" and llm.backend.mrope is not None
        yield ref, llm


def test_logits_after_an_image_equal_the_ort_backends(pair, rng):
    """Prefill and the decode steps after it: the offsets (and Qwen3-VL's deepstack rows) reach the engines."""
    ref, llm = pair
    img = random_image(rng, 100, 160)
    ids = ref.prepare(ask(img), chat=True).ids
    assert np.array_equal(llm.prepare(ask(img), chat=True).ids, ids)
    logits = []
    for backend in (ref.backend, llm.backend):
        cache = backend.allocate(1)
        out = [backend.prefill(cache, [0], [ids], True)]
        for _ in range(3):
            out.append(backend.decode(cache, [0], out[-1].next_token.copy(), True))
        logits.append(np.stack([o.logits[0] for o in out]))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    engines = {n: rec.profile for n, rec in llm.manifest.engines.items()}
    assert all("rope_offsets" in engines[n] for n in ("prefill", "decode", "verify"))
    assert ("deepstack_embeds" in engines["prefill"]) == bool(llm.manifest.model.images.deepstack_layers)


def test_image_prompts_give_the_ort_backends_tokens(pair, emulator, rng):
    """Several sizes, two images in one message and a text prompt; then the same prompts as one batch."""
    ref, llm = pair
    asks = [ask(random_image(rng, h, w)) for h, w in ((70, 50), (20, 30), (120, 300))]
    asks += [ask(random_image(rng, 90, 60), random_image(rng, 64, 64), text="and"), [{"role": "user", "content": "Hi"}]]
    want = [ref.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks]
    assert [llm.chat(m, max_new_tokens=6, temperature=0).token_ids for m in asks] == want
    assert "vision.onnx" in emulator[1].deserialized  # the vision engine encoded, not an ORT session
    batch = llm.generate_many([{"messages": m, "max_new_tokens": 6, "temperature": 0} for m in asks[:4]])
    assert [r.token_ids for r in batch] == want[:4]


def test_verify_passes_after_an_image_equal_decode_steps(pair, rng):
    """The verify engine binds the rows' offsets: its logits after an image equal the decode steps' (1 and 2 rows),
    and n-gram speculation gives the plain greedy tokens."""
    ref, llm = pair
    img = random_image(rng, 100, 160)
    ids = llm.prepare(ask(img), chat=True).ids
    backend = llm.backend
    check_verify_after_prefill(backend, ids)
    runs = backend.stats["verify_runs"]
    # n-gram drafts need the text to repeat a token: over 48 greedy tokens of a 600-token random model it did in every
    # run seen (2-22 verify passes); over 24 tokens with "> runs + 2" it failed once in two suites
    plain = llm.chat(ask(img), max_new_tokens=48, temperature=0).token_ids
    assert llm.chat(ask(img), max_new_tokens=48, temperature=0, speculative="ngram").token_ids == plain
    assert backend.stats["verify_runs"] > runs, "no verify pass ran"


def test_a_follow_up_and_a_chunked_prefill_equal_a_full_prefill(pair, rng):
    """A session's second turn reuses the image and equals a re-prefill; prefill chunks shorter than the image
    (each chunk's offsets from the ids its row already holds) give the tokens of one call."""
    ref, llm = pair
    img = random_image(rng, 120, 300)  # 72 image tokens
    chat = llm.session()
    first = chat.chat(ask(img, text="What?")[0], max_new_tokens=5, temperature=0)
    second = chat.chat("And the colour?", max_new_tokens=5, temperature=0)
    assert chat.last_turn.reused_tokens >= first.metrics.prompt_tokens
    assert second.token_ids == ref.chat(chat.history[:-1], max_new_tokens=5, temperature=0).token_ids
    chat.close()
    want = ref.chat(ask(img), max_new_tokens=6, temperature=0).token_ids
    llm.backend.max_prefill = 20  # the host staging was sized for the profile's longer chunks
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    assert llm.chat(ask(img), max_new_tokens=6, temperature=0).token_ids == want


def test_engines_built_before_the_offsets_take_text_only(artifact, emulator, tmp_path, rng):
    """Engines that fold rope_offsets (built before this change) still run text; an image gets one line."""
    import shutil

    from decodert.errors import DecodertError
    from decodert.runtime.llm import LLM

    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for rec in manifest["engines"].values():
        for name in ("rope_offsets", "deepstack_embeds"):
            rec["profile"].pop(name, None)
    for name in manifest["engines"]:  # the emulated blobs carry their profile too
        blob = json.loads((old / f"{name}.engine").read_bytes())
        blob["profile"] = manifest["engines"][name]["profile"]
        data = json.dumps(blob).encode()
        (old / f"{name}.engine").write_bytes(data)
        manifest["engines"][name].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (old / "manifest.json").write_text(json.dumps(manifest))
    with LLM.load(old, backend="trt", verify="none") as llm, LLM.load(artifact, backend="ort") as ref:
        assert llm.backend.mrope is None and llm.vision is None
        msgs = [{"role": "user", "content": "Hi"}]
        assert llm.chat(msgs, max_new_tokens=5, temperature=0).token_ids == \
            ref.chat(msgs, max_new_tokens=5, temperature=0).token_ids
        with pytest.raises(DecodertError, match="run `decodert build` again") as e:
            llm.chat(ask(random_image(rng, 64, 64)), max_new_tokens=2)
        assert "\n" not in str(e.value)


@pytest.mark.trt
@pytest.mark.parametrize("kind", KINDS)
def test_tensorrt_rtx_builds_the_engines_with_offsets_and_deepstack(kind, tmp_path):
    """TensorRT-RTX (on the CPU) parses and builds every engine with rope_offsets kept (profiles over each graph's
    batch and seq), the prefill engine with the image inputs (and deepstack_embeds: image_tokens 0 .. B*S), and the
    vision engine over patch rows with the tower's extra inputs."""
    pytest.importorskip("tensorrt_rtx_bindings")
    from decodert.export import trt_build
    from decodert.export.pipeline import export_model

    hf = make_tiny_qwen_vl(tmp_path / "hf", seed=1, kind=kind)
    out = tmp_path / "trt"
    export_model(hf, out, target="trt", dtype="fp16", max_seq=128, max_batch=2, progress=False, plugins="never")
    engines = trt_build.build_engines(out, progress=False)
    inputs = {n: [t["name"] for t in rec.io["inputs"]] for n, rec in engines.items()}
    assert engines["prefill"].profile["rope_offsets"] == {"min": [3, 1, 1], "opt": [3, 1, 128], "max": [3, 2, 128]}
    assert engines["decode"].profile["rope_offsets"] == {"min": [3, 1, 1], "opt": [3, 2, 1], "max": [3, 2, 1]}
    assert engines["verify"].profile["rope_offsets"]["max"] == [3, 2, 16]
    assert all("rope_offsets" in inputs[n] for n in ("prefill", "decode", "verify"))
    deep = kind == "qwen3_vl"
    assert ("deepstack_embeds" in inputs["prefill"]) == deep and "deepstack_embeds" not in inputs["decode"]
    if deep:
        assert engines["prefill"].profile["deepstack_embeds"]["max"] == [2, 256, 64]
    tower = ["pos_indices", "pos_weights"] if deep else ["patch_windows"]
    assert inputs["vision"] == ["pixel_values", "patch_positions", *tower]
    assert all(engines["vision"].profile[n]["max"][0] == 256 for n in inputs["vision"])


def test_the_prefix_cache_resumes_inside_an_image(pair, rng):
    """Whole cached blocks end inside the image: the rest of it still gets its positions (from the ids held)."""
    ref, llm = pair
    if llm.prefix_cache is None:
        pytest.skip("the prefix cache is off")
    img = random_image(rng, 120, 300)
    llm.chat(ask(img, text="What is it?"), max_new_tokens=3, temperature=0)
    again = llm.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0)
    assert again.metrics.cached_tokens >= 32
    assert again.token_ids == ref.chat(ask(img, text="Which colour is it?"), max_new_tokens=6, temperature=0).token_ids


def test_a_video_prompt_gives_the_ort_backends_tokens(pair, rng):
    """Video slices (Qwen2.5-VL: one grid with a time step; Qwen3-VL: a grid per slice) through the vision engine
    and the engines' rope_offsets, beside an image (tests/vision/test_vision_qwen_video.py compares ort with transformers)."""
    ref, llm = pair
    frames = rng.integers(0, 256, (6, 48, 64, 3), dtype=np.uint8)
    msgs = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 1.0},
                                         {"type": "image", "image": random_image(rng, 50, 70)},
                                         {"type": "text", "text": "What happens?"}]}]
    assert llm.chat(msgs, max_new_tokens=6, temperature=0).token_ids == \
        ref.chat(msgs, max_new_tokens=6, temperature=0).token_ids
