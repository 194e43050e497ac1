"""Sessions on disk (runtime/chat/saved.py): ``Session.save`` then ``LLM.resume`` in a new ``LLM.load`` gives the next
turn the live session gives, greedy token for token and with the same reuse (``last_turn``), on tiny random
checkpoints: dense, the hybrids (LFM2 conv, Qwen3.5 Gated DeltaNet, Nemotron-H Mamba2: states and the row's
snapshot), across the ort backend and the trt backend on the emulator (device K/V and states), and Qwen3.5 with an
image. Damaged, truncated, foreign and other-kv_dtype files are refused in one line; fp32 <-> fp16 K/V convert only
when asked, exactly as ``astype`` rounds; an int8 cache never converts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from decodert.errors import DamagedState, DecodertError
from decodert.export.pipeline import export_model
from decodert.runtime.llm import LLM

QUESTIONS = ["hello world", "the quick brown fox", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def art(tiny_checkpoint, tmp_path_factory):
    """art(family, target="ort", **export options) -> an fp32 export of the tiny checkpoint, once per arguments."""
    pytest.importorskip("transformers")
    made: dict[tuple, Path] = {}

    def get(family: str, target: str = "ort", **options) -> Path:
        key = (family, target, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"saved-{family}-{target}") / "art"
            export_model(tiny_checkpoint(family), out, target=target, dtype="fp32", max_seq=192, max_batch=2,
                         progress=False, **options)
            if target == "trt":
                import trt_emulator

                trt_emulator.emulate_engines(out, max_seq=16, scratch={"prefill": 8192, "decode": 4096, "verify": 16384})
            made[key] = out
        return made[key]

    return get


def _live(llm, turns=2):
    session = llm.session(system="be brief")
    for q in QUESTIONS[:turns]:
        session.chat(q, max_new_tokens=8, temperature=0)
    return session


def _check_resumed_turn(session, resumed):
    """The resumed session holds what the saved one held, and its next turn is the live one's."""
    assert resumed.history == session.history and resumed.system == "be brief"
    assert resumed.cached_tokens == session.cached_tokens > 0
    assert np.array_equal(resumed.row.cache.held(0), session.row.cache.held(0))
    live = session.chat(QUESTIONS[2], max_new_tokens=10, temperature=0)
    got = resumed.chat(QUESTIONS[2], max_new_tokens=10, temperature=0)
    assert got.token_ids == live.token_ids
    assert resumed.last_turn == session.last_turn  # the same reuse: the row (and a hybrid's snapshot) came back
    assert resumed.last_turn.reused_tokens > 0


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen3_5", "nemotron_h"])
def test_a_resumed_session_gives_the_live_next_turn(art, family, tmp_path):
    path = tmp_path / "chat.session"
    with LLM.load(art(family)) as llm:
        session = _live(llm)
        assert session.save(path) == path.stat().st_size
        with LLM.load(art(family)) as fresh:
            _check_resumed_turn(session, fresh.resume(path))
            if family != "llama":  # a checksummed file whose states are not the model's: refused, not committed
                from decodert.runtime.persist.records import read_record, write_record

                rec = read_record(path)
                write_record(tmp_path / "bad", rec.identity, "session", {**rec.arrays, "state.0": rec.arrays["state.0"][1:]},
                             rec.meta)
                with pytest.raises(DamagedState, match="its states are not this model's"):
                    fresh.resume(tmp_path / "bad")


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_one_file_loads_on_ort_and_on_the_trt_backend(art, family, tmp_path, monkeypatch):
    """A trt-target artifact run by both backends (trt on the emulator: K/V blocks and states in device memory)."""
    import trt_emulator

    trt_emulator.install(monkeypatch)
    folder = art(family, "trt")
    for saver, loader in (("ort", "trt"), ("trt", "ort")):
        path = tmp_path / f"{saver}.session"
        with LLM.load(folder, backend=saver) as llm:
            assert llm.backend.name == saver
            session = _live(llm)
            session.save(path)
            with LLM.load(folder, backend=loader) as other:
                resumed = other.resume(path)
                assert other.backend.name == loader and resumed.row.cache.device == ("cuda" if loader == "trt" else "cpu")
                _check_resumed_turn(session, resumed)


def test_a_session_with_an_image_resumes_with_its_image(tmp_path_factory, tmp_path, rng):
    pytest.importorskip("transformers")
    pytest.importorskip("PIL.Image")
    from tiny_qwen_vl import ask, make_tiny_qwen_vl, random_image

    root = tmp_path_factory.mktemp("saved-qwen3_5-vl")
    export_model(make_tiny_qwen_vl(root / "hf", kind="qwen3_5"), root / "art", target="ort", dtype="fp32", max_seq=512,
                 max_batch=2, progress=False)
    image = random_image(rng, 100, 160)
    image_file = tmp_path / "picture.png"
    from PIL import Image

    Image.fromarray(image).save(image_file)
    path = tmp_path / "vl.session"
    with LLM.load(root / "art") as llm:
        session = llm.session()
        message = ask(image_file, text="What?")[0]  # the image as a path: the file keeps its pixels, not the path
        session.chat(message, max_new_tokens=5, temperature=0)
        frames = rng.integers(0, 256, (4, 48, 64, 3), dtype=np.uint8)  # a clip of 4 frames taken at 2 a second
        session.chat({"role": "user", "content": [{"type": "video", "video": list(frames), "fps": 2.0},
                                                  {"type": "text", "text": "And this?"}]}, max_new_tokens=5, temperature=0)
        session.save(path)
        live = session.chat("And the colour?", max_new_tokens=6, temperature=0)
    image_file.unlink()  # the saved session has the pixels
    with LLM.load(root / "art") as fresh:
        resumed = fresh.resume(path)
        part = resumed.history[0]["content"][0]
        assert part["type"] == "image" and np.array_equal(part["image"], image)
        video = resumed.history[2]["content"][0]
        assert video["fps"] == 2.0 and np.array_equal(video["video"], frames)
        got = resumed.chat("And the colour?", max_new_tokens=6, temperature=0)
        assert got.token_ids == live.token_ids
        assert resumed.last_turn.reused_tokens == session.last_turn.reused_tokens >= got.metrics.prompt_tokens // 2


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_damaged_truncated_and_foreign_files_are_refused_in_one_line(art, tmp_path):
    path = tmp_path / "chat.session"
    with LLM.load(art("llama")) as llm:
        session = _live(llm)
        session.save(path)
        data = path.read_bytes()
        for name, bad in (("cut", data[: len(data) // 2]), ("flip", data[:200] + bytes([data[200] ^ 1]) + data[201:]),
                          ("empty", b""), ("text", b"hello, not a session\n")):
            (tmp_path / name).write_bytes(bad)
            with pytest.raises(DamagedState) as e:
                llm.resume(tmp_path / name)
            _one_line(e, str(tmp_path / name))
        from decodert.runtime.persist.records import artifact_identity, read_record, write_record

        rec = read_record(path)
        write_record(tmp_path / "v99", rec.identity, "session", rec.arrays, {**rec.meta, "session_version": 99})
        write_record(tmp_path / "block", artifact_identity(llm.manifest), "prefix-block", rec.arrays, rec.meta)
        for name, change in (("turns", {"turns": 3}), ("ids", {"positions": 5}), ("snap", {"snapshot": -1}),
                             ("role", {"turns": [{"content": "no role"}]}), ("row", {"row": False, "positions": 0}),
                             ("img", {"turns": [{"role": "user", "content": [{"type": "image", "image": {"saved": "x"}}]}]})):
            write_record(tmp_path / name, rec.identity, "session", rec.arrays, {**rec.meta, **change})
        for name, message in (("v99", "session format version 99"), ("block", "holds 'prefix-block', not 'session'"),
                              ("turns", "damaged session file"), ("ids", "damaged session file (ids)"),
                              ("snap", "damaged session file (snapshot)"), ("img", "damaged session file (image 'x')"),
                              ("role", "damaged session file (turns: chat message 0"), ("row", "(ids)")):
            with pytest.raises(DamagedState) as e:
                llm.resume(tmp_path / name)
            _one_line(e, str(tmp_path / name), message)
        states = {**rec.arrays, "kv": rec.arrays["kv"][:-4]}  # a checksummed file whose K/V are short
        write_record(tmp_path / "short", rec.identity, "session", states, rec.meta)
        with pytest.raises(DamagedState) as e:
            llm.resume(tmp_path / "short")
        _one_line(e, "damaged session file (kv:")
        with pytest.raises(DecodertError) as e:
            llm.resume(tmp_path / "missing.session")
        _one_line(e, "missing.session", "cannot read")
        assert session.save(path) == len(data)  # the live session is untouched by the failures
    with LLM.load(art("lfm2")) as other:
        with pytest.raises(DamagedState) as e:
            other.resume(path)
        _one_line(e, str(path), "another artifact")


def test_a_failed_save_keeps_the_earlier_file_and_the_session(art, tmp_path):
    path = tmp_path / "chat.session"
    with LLM.load(art("llama")) as llm:
        session = _live(llm, 1)
        session.save(path)
        before = path.read_bytes()
        with pytest.raises(DecodertError) as e:
            session.save(tmp_path / "no" / "such" / "dir.session")
        _one_line(e, "cannot write the session")
        stream = session.stream_chat(QUESTIONS[1], max_new_tokens=8, temperature=0)
        next(iter(stream))
        with pytest.raises(DecodertError, match="a turn is streaming"):
            session.save(path)
        stream.close()
        assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["chat.session"]
        session.save(path)
        assert llm.resume(path).history == session.history


def test_another_kv_dtype_converts_only_when_asked(art, tmp_path):
    path = tmp_path / "fp32.session"
    with LLM.load(art("llama")) as llm:
        session = _live(llm)
        session.save(path)
        held = session.row.cache
        want = np.stack([b[0, :, : session.cached_tokens] for b in held.buffers])  # [2L, H, n, D] fp32
    with LLM.load(art("llama", kv_dtype="fp16")) as half:
        with pytest.raises(DecodertError) as e:
            half.resume(path)
        _one_line(e, "fp32 K/V cache", "fp16", "convert_kv=True")
        resumed = half.resume(path, convert_kv=True)
        n = resumed.cached_tokens
        got = np.stack([b[0, :, :n] for b in resumed.row.cache.buffers])
        assert got.dtype == np.float16 and np.array_equal(got, want.astype(np.float16))
        back = tmp_path / "fp16.session"
        resumed.save(back)
        live_half = _live(half)  # the fp16 cache's own session of the same turns reuses as much
        r = resumed.chat(QUESTIONS[2], max_new_tokens=4, temperature=0)
        assert r.metrics.cached_tokens == live_half.chat(QUESTIONS[2], max_new_tokens=4, temperature=0).metrics.cached_tokens
    with LLM.load(art("llama")) as full:
        again = full.resume(back, convert_kv=True)  # fp16 -> fp32 is exact
        assert np.array_equal(np.stack([b[0, :, :n] for b in again.row.cache.buffers]),
                              want.astype(np.float16).astype(np.float32))
    with LLM.load(art("llama", kv_dtype="int8")) as codes:
        with pytest.raises(DecodertError) as e:
            codes.resume(path, convert_kv=True)
        _one_line(e, "int8", "cannot be converted")


def test_a_row_under_a_lora_adapter_resumes_only_under_that_adapter(tiny_checkpoint, tmp_path):
    pytest.importorskip("peft")
    from tiny import make_adapter

    from decodert.artifact.lora_layout import LoraLayout

    base = tiny_checkpoint("llama")
    sql = make_adapter(base, tmp_path / "sql", 4, 8, ["q_proj", "v_proj"], 1)
    other = make_adapter(base, tmp_path / "other", 4, 8, ["q_proj", "v_proj"], 2)
    art = tmp_path / "art"
    export_model(base, art, max_seq=128, max_batch=2, progress=False, lora=LoraLayout(2, 4))
    path = tmp_path / "lora.session"
    with LLM.load(art, adapters={"sql": sql}) as llm:
        session = llm.session()
        for q in QUESTIONS[:2]:
            session.chat(q, max_new_tokens=6, temperature=0, adapter="sql")
        session.save(path)
        live = session.chat(QUESTIONS[2], max_new_tokens=8, temperature=0, adapter="sql")
    with LLM.load(art, adapters={"x": other, "sql": sql}) as fresh:  # another slot and load tag, the same files
        resumed = fresh.resume(path)
        got = resumed.chat(QUESTIONS[2], max_new_tokens=8, temperature=0, adapter="sql")
        assert got.token_ids == live.token_ids and resumed.last_turn == session.last_turn
    for adapters in ({"sql": other}, {}):
        with LLM.load(art, adapters=adapters) as wrong:
            with pytest.raises(DamagedState) as e:
                wrong.resume(path)
            _one_line(e, "LoRA adapter 'sql'", "not loaded here")
