"""A prefill interrupted between two graph runs of a hybrid row (Ctrl-C in a session turn, a step that fails under
the server's engine) leaves the row as its record says (runtime/backends/kv_cache.py ``KVCache.writing``): the next
turn or request on that row, and the prefix cache, give the tokens of a fresh LLM.

The interrupt is injected after the graph of the second prefill run has written the row's states in place and
before anything committed them: where Ctrl-C lands when it arrives while ONNX Runtime (or TensorRT) runs."""

from __future__ import annotations

import threading

import numpy as np
from pathlib import Path
import pytest

from tiny import make_tiny_checkpoint  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.export.pipeline import export_model  # noqa: E402
from decodert.runtime.backends.ort import backend as ort_backend  # noqa: E402
from decodert.runtime.engine.thread import EngineThread as Engine  # noqa: E402
from decodert.runtime.llm import LLM  # noqa: E402

CHUNK = 16  # $DECODERT_PREFILL_CHUNK: a 60-token prompt runs in four calls
LONG = ("The cache keeps keys and values of earlier positions so each step only computes one token. "
        "Once upon a time there was a small model.")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
SEED = 5  # the random prompt ids of the engine test
GREEDY = dict(max_new_tokens=10, temperature=0, logprobs=True)
# A conv window or a small recurrent state left over moves the logits by about 1e-3 on these tiny models (LFM2,
# Nemotron-H), too little to change a greedy token: the answers' log-probabilities are compared too.
ATOL = 2e-5


def same(got, want) -> None:
    """Greedy answers with the same tokens and log-probabilities (up to a different split of the prompt's calls)."""
    assert got.token_ids == want.token_ids
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs))
    assert diff < ATOL, f"log-probabilities differ by {diff:.2e}"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, target: str = "ort") -> Path:
        if (family, target) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{target}")
            export_model(make_tiny_checkpoint(family, root / "src"), root / "art", target=target, dtype="fp32",
                         max_seq=160, max_batch=2, progress=False)
            made[family, target] = root / "art"
        return made[family, target]

    return get


@pytest.fixture(autouse=True)
def chunked(monkeypatch):
    monkeypatch.setenv("DECODERT_PREFILL_CHUNK", str(CHUNK))


def interrupt_ort(monkeypatch, on_call: int, error: BaseException) -> list[int]:
    """The ort backend's prefill runs: the ``on_call``-th (from 1) runs its graph, then raises ``error``."""
    real, calls = ort_backend._run_bound, []

    def run(session, io, folder, kind):
        real(session, io, folder, kind)
        if kind == "prefill":
            calls.append(len(calls) + 1)
            if len(calls) == on_call:
                raise error

    monkeypatch.setattr(ort_backend, "_run_bound", run)
    return calls


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("prefix_mb", [0, 8])
def test_a_session_turn_interrupted_between_chunks(artifacts, monkeypatch, family, prefix_mb):
    """Ctrl-C in the second prefill run of a session's first turn, then the same turn again: the answer is a fresh
    session's, and a plain request afterwards (which the prefix cache may serve) equals a fresh LLM's."""
    art = artifacts(family)
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as fresh:
        want = fresh.session(system="be brief").chat(LONG, **GREEDY)
        plain = fresh.chat(MESSAGES, **GREEDY)
    llm = LLM.load(art, backend="ort", prefix_cache_mb=prefix_mb)
    session = llm.session(system="be brief")
    with monkeypatch.context() as patch:
        calls = interrupt_ort(patch, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            session.chat(LONG, **GREEDY)
        assert calls == [1, 2] and session.history == [{"role": "system", "content": "be brief"}]
    same(session.chat(LONG, **GREEDY), want)
    assert session.history[:-1] == MESSAGES
    same(llm.chat(MESSAGES, **GREEDY), plain)
    same(llm.chat(MESSAGES, **GREEDY), plain)  # the second one loads what the first stored


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "nemotron_h"])
def test_a_later_turn_interrupted_between_chunks(artifacts, monkeypatch, family):
    """The row held a turn (and its snapshot at that prompt's end) when the next turn's prefill was interrupted:
    that turn again equals a fresh session's two turns."""
    art = artifacts(family)
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as fresh:
        ref = fresh.session()
        ref.chat("Hello world!", max_new_tokens=6)
        want = ref.chat(LONG, **GREEDY)
    session = LLM.load(art, backend="ort", prefix_cache_mb=0).session()
    session.chat("Hello world!", max_new_tokens=6)
    with monkeypatch.context() as patch:
        interrupt_ort(patch, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            session.chat(LONG, **GREEDY)
    same(session.chat(LONG, **GREEDY), want)


def _engine_run(engine: Engine, ids: np.ndarray, n: int):
    """Submit one greedy request and wait for its last event."""
    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if event.last:
            done.set()

    engine.submit(engine.sequence(engine.llm.prepare(ids, max_new_tokens=n, temperature=0, logprobs=True)), sink)
    assert done.wait(120), "the engine gave no last event"
    return events[-1]


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5", "nemotron_h"])
def test_a_server_request_failing_between_chunks(artifacts, monkeypatch, family):
    """Under the server's engine a step fails in the second prefill run of a request: it ends with its error;
    the next requests on that row (the second one from the prefix cache) give a fresh LLM's tokens."""
    art = artifacts(family)
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(3, 400, 70)  # two prefix-cache blocks of 32, then six tokens
    with LLM.load(art, backend="ort", prefix_cache_mb=0) as fresh:
        want = fresh.generate(prompt, **GREEDY)
    llm = LLM.load(art, backend="ort", prefix_cache_mb=8)
    engine = Engine(llm).start()
    try:
        with monkeypatch.context() as patch:
            interrupt_ort(patch, 2, DecodertError("injected failure"))
            failed = _engine_run(engine, prompt, 10)
        assert failed.error is not None and "injected failure" in failed.error
        again = _engine_run(engine, prompt, 10)
        same(again.result, want)
        assert again.result.metrics.cached_tokens == 0  # the failed request stored nothing
        hit = _engine_run(engine, prompt, 10)
        same(hit.result, want)
        assert hit.result.metrics.cached_tokens > 0
    finally:
        engine.stop()


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_a_trt_session_turn_interrupted_between_chunks(artifacts, monkeypatch, family):
    """The trt backend (tests/helpers/trt_emulator.py; a prefill profile of 16 tokens) commits each chunk after its run:
    an interrupt between a chunk's run and its commit leaves the row at the chunks before it."""
    import trt_emulator

    from decodert.runtime.backends.trt.backend import TrtBackend

    art = artifacts(family, "trt")
    trt_emulator.emulate_engines(art, max_seq=CHUNK)
    trt_emulator.install(monkeypatch)
    with LLM.load(art, backend="trt", prefix_cache_mb=0) as fresh:
        want = fresh.session().chat(LONG, **GREEDY)
    llm = LLM.load(art, backend="trt", prefix_cache_mb=0)
    session = llm.session()
    real, runs = TrtBackend.execute, []

    def execute(self, ctx, what):
        real(self, ctx, what)
        runs.append(what)
        if runs.count("prefill") == 2 and what == "prefill":
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(TrtBackend, "execute", execute)
        with pytest.raises(KeyboardInterrupt):
            session.chat(LONG, **GREEDY)
    same(session.chat(LONG, **GREEDY), want)
    llm.close()
