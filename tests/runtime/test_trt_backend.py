"""runtime/backends/trt/backend.py on the CPU, through tests/helpers/trt_emulator.py (CUDA memory, streams, graphs and
TensorRT contexts emulated; the graphs run on ONNX Runtime): the same tokens as the ort backend on
the same trt-target artifact, every path of the backend, and the misuse the emulator catches."""

from __future__ import annotations


import numpy as np
import pytest

import trt_emulator  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.llm import LLM, Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

MAX_SEQ = 48


@pytest.fixture(scope="module")
def trt_artifact(tmp_path_factory, tiny_checkpoint):
    """A tiny llama trt-target fp32 artifact with emulated engines (prefill profile: 16 tokens a chunk)."""
    out = tmp_path_factory.mktemp("trt-emu") / "art"
    export_model(tiny_checkpoint("llama"), out, target="trt", dtype="fp32", max_seq=MAX_SEQ, max_batch=4, progress=False)
    trt_emulator.emulate_engines(out, max_seq=16, scratch={"prefill": 8192, "decode": 4096, "verify": 16384})
    return out


@pytest.fixture
def emulator(monkeypatch):
    return trt_emulator.install(monkeypatch)


def prompts(llm: LLM) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    v = llm.backend.vocab_size
    return [rng.integers(3, v, n) for n in (5, 23, 9, 2)]  # 23: two prefill chunks of the 16-token profile


def test_same_tokens_as_ort(trt_artifact, emulator):
    device, _ = emulator
    with LLM.load(trt_artifact, backend="ort") as ref, LLM.load(trt_artifact, backend="trt") as llm:
        assert llm.backend.name == "trt"
        ps = prompts(ref)
        want = [ref.generate(p, max_new_tokens=12, temperature=0).token_ids for p in ps]
        got = [llm.generate(p, max_new_tokens=12, temperature=0).token_ids for p in ps]
        assert got == want
        batch = llm.generate(ps, max_new_tokens=12, temperature=0)  # one batch: rows of different lengths
        assert [r.token_ids for r in batch] == want
        stats = llm.backend.stats
    assert stats["captures"] >= 1 and stats["graph_launches"] > 0  # decode steps replayed a CUDA graph
    assert device.counts["replays"] == stats["graph_launches"]


def test_continuous_batching_moves_slots(trt_artifact, emulator):
    with LLM.load(trt_artifact, backend="ort") as ref, LLM.load(trt_artifact, backend="trt") as llm:
        ps = prompts(ref) * 2
        lens = [3, 14, 6, 9, 11, 2, 8, 5]
        reqs = [Request(p, SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(ps, lens)]
        want = [r.token_ids for r in ref.generate_many(reqs)]
        got = [r.token_ids for r in llm.generate_many(reqs)]
    assert got == want


def test_context_fills_up(trt_artifact, emulator):
    with LLM.load(trt_artifact, backend="ort") as ref, LLM.load(trt_artifact, backend="trt") as llm:
        p = prompts(ref)[1]
        want = ref.generate(p, max_new_tokens=100, temperature=0)
        got = llm.generate(p, max_new_tokens=100, temperature=0)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"


def test_emulator_catches_an_overrun(emulator):
    device, _ = emulator
    from decodert.plugins import cuda_mem as cm

    stream, a, b = cm.Stream(), cm.DeviceBuffer(16), cm.PinnedArray((2,), np.int64)
    with pytest.raises(trt_emulator.EmulatorError, match="overrun"):
        cm.copy_async(a.ptr, b.ptr, 32, stream, "h2d")
    with pytest.raises(trt_emulator.EmulatorError, match="memory, expected"):
        cm.copy_async(b.ptr, a.ptr, 16, stream, "h2d")


def test_missing_engine_is_one_line(trt_artifact, emulator, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(trt_artifact, art)
    (art / "decode.engine").unlink()
    with pytest.raises(DecodertError, match="decode.engine: missing"):
        LLM.load(art, backend="trt")


def test_padded_prefill_stays_inside_the_context(trt_artifact, emulator):
    """A short row near the end of its context beside a longer one: padding the short row to the
    call's width would write K/V past max_seq (on a GPU, into the next head's cache), so it runs alone."""
    rng = np.random.default_rng(0)
    a, b, c = rng.integers(3, 60, 40), rng.integers(3, 60, 5), rng.integers(3, 60, 16)
    got = {}
    for name in ("ort", "trt"):
        with LLM.load(trt_artifact, backend=name) as llm:
            cache = llm.backend.allocate(2)
            llm.backend.prefill(cache, [0], [a], want_logits=False)
            out = llm.backend.prefill(cache, [0, 1], [b, c], want_logits=True)
            got[name] = (out.next_token, out.logits, cache.lengths.copy())
    assert (got["trt"][0] == got["ort"][0]).all() and (got["trt"][2] == [45, 16]).all()
    np.testing.assert_allclose(got["trt"][1], got["ort"][1], atol=1e-5)


def test_verify_equals_decode_steps(trt_artifact, emulator):
    """One verify call of rows over their caches returns what decoding the same tokens one by one does."""
    rng = np.random.default_rng(1)
    with LLM.load(trt_artifact, backend="trt") as llm:
        be = llm.backend
        assert be.verify_width == 16
        cache = be.allocate(3)
        prompts_ = [rng.integers(3, 60, n) for n in (7, 12, 3)]
        be.prefill(cache, [0, 1, 2], prompts_, want_logits=False)
        drafts = [rng.integers(3, 60, n) for n in (5, 1, 16)]
        start = cache.lengths.copy()
        out = be.verify(cache, [0, 1, 2], drafts, want_logits=True)
        assert (cache.lengths == start + [5, 1, 16]).all() and out.next_tokens.shape == (3, 16)
        for j, d in enumerate(drafts):  # decode the same tokens one at a time from the same cache state
            cache.rewind(j, int(start[j]))
            for i, t in enumerate(d):
                step = be.decode(cache, [j], np.array([t]), want_logits=True)
                assert step.next_token[0] == out.next_tokens[j, i]
                np.testing.assert_allclose(step.logits[0], out.logits[j, i], atol=2e-5)
        assert be.stats["verify_runs"] == 1  # three rows, one call
        assert be.verifier.own_scratch is not None  # its engine wants more scratch than prefill/decode share


@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_greedy_is_plain_greedy(trt_artifact, emulator, batch):
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    _, trt = emulator
    with LLM.load(trt_artifact, backend="trt") as llm:
        rng = np.random.default_rng(4)
        ps = [np.tile(rng.integers(3, 60, 5), 3), rng.integers(3, 60, 9), np.tile(rng.integers(3, 60, 3), 4),
              rng.integers(3, 60, 4)][:batch]
        plain = [llm.generate(p, max_new_tokens=30, temperature=0).token_ids for p in ps]
        assert "verify.onnx" not in trt.deserialized  # plain decoding never opens the verify engine
        fixed = SpeculativeConfig(adaptive=False, draft_len=6)
        reqs = [Request(p, SamplingParams(max_new_tokens=30, temperature=0), speculative=fixed) for p in ps]
        spec = llm.generate_many(reqs)
        assert [r.token_ids for r in spec] == plain
        assert "verify.onnx" in trt.deserialized and llm.backend.stats["verify_runs"] > 0
        assert max(r.metrics.accepted_per_step for r in spec) > 1.0


def test_speculative_sampling_runs(trt_artifact, emulator):
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    with LLM.load(trt_artifact, backend="trt") as llm:
        p = np.tile(np.arange(10, 16), 3)
        fixed = SpeculativeConfig(adaptive=False)
        a = llm.generate(p, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=3, speculative=fixed)
        b = llm.generate(p, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=3, speculative=fixed)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_engines_built_before_verify(trt_artifact, emulator, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(trt_artifact, art)
    trt_emulator.emulate_engines(art, max_seq=16, graphs=("prefill", "decode"))
    with LLM.load(art, backend="trt") as llm:
        assert llm.generate([5, 6, 7], max_new_tokens=3, temperature=0).token_ids
        with pytest.raises(DecodertError, match="no verify engine.*decodert build"):
            llm.generate([5, 6, 7], max_new_tokens=3, speculative="ngram")
        cache = llm.backend.allocate(1)
        with pytest.raises(DecodertError, match="has no verify engine .*run `decodert build"):  # the backend says it too
            llm.backend.verify(cache, [0], [np.array([5, 6])], want_logits=False)


def test_prefix_cache_reuses_device_blocks(trt_artifact, emulator):
    """A prompt that starts like an earlier one loads the cached K/V blocks (device copies,
    runtime/backends/kv_blocks.py) instead of prefilling them, and answers as the ort backend does."""
    rng = np.random.default_rng(5)
    first = rng.integers(3, 60, 34)
    second = np.concatenate([first, rng.integers(3, 60, 6)])
    got = {}
    for name in ("ort", "trt"):
        with LLM.load(trt_artifact, backend=name) as llm:
            got[name] = [llm.generate(p, max_new_tokens=6, temperature=0).token_ids for p in (first, second)]
            if name == "trt":
                assert llm.prefix_cache is not None and llm.prefix_cache.stats.hit_tokens >= 32
    assert got["trt"] == got["ort"]


def test_decodert_verify_command(trt_artifact, emulator, capsys):
    """`decodert verify` (engines vs ONNX Runtime, then the verify engine vs the decode steps) runs end to end."""
    from decodert.cli import main
    from decodert.tools.verify import verify

    res = verify(trt_artifact, steps=8, rows=3)
    assert res["greedy_agreement"] == 1.0 and res["max_abs_logit_err"] < 1e-4, res
    assert res["verify_width"] == 8 and res["verify_agreement"] == 1.0 and res["verify_max_abs_logit_err"] < 1e-4
    assert res["backend_stats"]["graph_launches"] >= 6 and res["backend_stats"]["verify_runs"] == 1
    assert main(["verify", str(trt_artifact), "--steps", "4"]) == 0
    assert "verify pass: 4 tokens a row" in capsys.readouterr().out


def test_slot_placement_and_move_slot(trt_artifact, emulator):
    """Rows at other slots (reversed, not a prefix) and a moved slot answer as at slots 0..n-1."""
    with LLM.load(trt_artifact, backend="trt") as llm:
        be = llm.backend
        ps = [np.array([5, 6, 7, 8, 9]), np.array([10, 11, 12])]
        cache = be.allocate(4)
        a = be.prefill(cache, [0, 1], ps, want_logits=True)
        b = be.prefill(cache, [3, 2], ps, want_logits=True)
        np.testing.assert_array_equal(a.next_token, b.next_token)
        da = be.decode(cache, [0, 1], a.next_token, want_logits=True)
        db = be.decode(cache, [3, 2], b.next_token, want_logits=True)
        np.testing.assert_array_equal(da.next_token, db.next_token)
        np.testing.assert_allclose(da.logits, db.logits, atol=1e-5)
        be.move_slot(cache, 3, 1)
        assert cache.lengths[1] == 6 and cache.lengths[3] == 0  # a moved row leaves its slot empty
        np.testing.assert_array_equal(cache.held(1), cache.held(0))
        x = be.decode(cache, [1], da.next_token[:1], want_logits=True)
        y = be.decode(cache, [0], da.next_token[:1], want_logits=True)
        np.testing.assert_array_equal(x.next_token, y.next_token)
        np.testing.assert_allclose(x.logits, y.logits, atol=1e-5)


def test_draft_model_on_trt(trt_artifact, emulator):
    """A draft model (here the artifact itself) on the trt backend too: its own cache slot per row,
    set back on rejection; greedy output is plain greedy's."""
    from decodert.runtime.speculation.speculative import SpeculativeConfig

    with LLM.load(trt_artifact, backend="trt", draft=trt_artifact) as llm:
        assert llm.backend.name == "trt"
        p = np.random.default_rng(6).integers(3, 60, 11)
        want = llm.generate(p, max_new_tokens=24, temperature=0).token_ids
        got = llm.generate(p, max_new_tokens=24, temperature=0,
                           speculative=SpeculativeConfig(method="draft", adaptive=False, draft_len=4))
        assert got.token_ids == want and got.metrics.accepted_per_step > 2.0  # a self-draft is always right


def test_bench_command_on_trt(trt_artifact, emulator, capsys):
    """`decodert bench --backend trt`, plainly and with prompt lookup (the figures a GPU run records)."""
    from decodert.cli import main

    args = ["bench", str(trt_artifact), "--backend", "trt", "--prompt-len", "8", "--gen", "8", "--batch", "1,2",
            "--repeats", "1"]
    assert main(args) == 0
    assert main([*args, "--speculative", "ngram"]) == 0
    out = capsys.readouterr().out
    assert "(trt," in out and "tok/step" in out, out


def test_capture_failure_falls_back_to_plain_runs(trt_artifact, emulator, monkeypatch):
    """A CUDA graph capture that fails warns once and leaves decode on execute_async_v3, same tokens."""
    from decodert.plugins import cuda_mem

    with LLM.load(trt_artifact, backend="ort") as ref:
        want = ref.generate([5, 6, 7, 8], max_new_tokens=10, temperature=0).token_ids

    def broken(stream, enqueue):
        raise DecodertError("cudaStreamBeginCapture failed: cudaErrorStreamCaptureUnsupported")

    monkeypatch.setattr(cuda_mem, "CudaGraph", broken)
    with LLM.load(trt_artifact, backend="trt") as llm:
        with pytest.warns(UserWarning, match="CUDA graph capture of the decode step .* failed"):
            got = llm.generate([5, 6, 7, 8], max_new_tokens=10, temperature=0).token_ids
        assert got == want
        assert llm.backend.stats["capture_failures"] == 1 and llm.backend.stats["graph_launches"] == 0


def test_engine_failure_is_one_line(trt_artifact, emulator, monkeypatch):
    with LLM.load(trt_artifact, backend="trt") as llm:
        monkeypatch.setattr(trt_emulator.Context, "execute_async_v3", lambda self, stream: False)
        with pytest.raises(DecodertError, match="TensorRT failed to run the prefill engine"):
            llm.generate([5, 6, 7], max_new_tokens=2, temperature=0)


def test_shape_outside_the_profile_names_the_fix(trt_artifact, emulator):
    """A verify call wider than the engine's profile (a hand-edited manifest) is refused by the context."""
    with LLM.load(trt_artifact, backend="trt") as llm:
        be = llm.backend
        be.verifier.width = 17  # past the profile's 16
        cache = be.allocate(1)
        be.prefill(cache, [0], [np.arange(3, 8)], want_logits=False)
        with pytest.raises(DecodertError, match="outside the engine's profile"):
            be.verify(cache, [0], [np.arange(3, 20)], want_logits=False)


def test_session_and_shared_cache_keep_their_cuda_graphs(trt_artifact, emulator):
    """Decode graphs bake a cache's addresses: switching between a session's row and the shared cache
    keeps both sets (nothing is captured again), and the tokens stay the ort backend's."""
    with LLM.load(trt_artifact, backend="ort") as ref:
        want = ref.generate([5, 6, 7, 8], max_new_tokens=8, temperature=0).token_ids
    with LLM.load(trt_artifact, backend="trt") as llm:
        session = llm.session()
        session.chat("hi", max_new_tokens=6, temperature=0)
        assert llm.generate([5, 6, 7, 8], max_new_tokens=8, temperature=0).token_ids == want
        captured = llm.backend.stats["captures"]
        assert captured == 2  # one decode graph for the session's row, one for the shared cache
        session.chat("and again", max_new_tokens=6, temperature=0)
        assert llm.generate([5, 6, 7, 8], max_new_tokens=8, temperature=0).token_ids == want
        assert llm.backend.stats["captures"] == captured and llm.backend.stats["graph_launches"] > 10
        session.close()  # a freed cache's graphs go with it; a new row captures its own
        session.chat("hi", max_new_tokens=6, temperature=0)
        assert llm.backend.stats["captures"] == captured + 1
