"""The server when the engine cannot run a request: a shared cache that cannot be allocated is refused at start
(exit 2, the line `generate` gives); an admission that raises fails its requests (500 generation_failed, one line),
never retried; /health's queue is empty once they have failed."""

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from fake_backend import make_llm  # noqa: E402
from serve_helpers import ROOT, export_tiny, running  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402

TOO_BIG = "the fp32 KV cache needs 48.83 GiB but only 22.86 GiB is available; export with a lower --max-seq or --max-batch"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "decodert", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_an_artifact_whose_cache_cannot_fit_is_refused_at_start(tmp_path):
    """40,000,000 slots x 512 tokens of fp32 K/V (~4.8 TiB): `serve` exits 2 before it listens, with `generate`'s line."""
    art = export_tiny(tmp_path, max_batch=40_000_000, max_seq=512)
    served, generated = _cli("serve", str(art), "--port", "0"), _cli("generate", str(art), "--prompt", "hi")
    assert served.returncode == generated.returncode == 2, served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and "serving" not in served.stderr, served.stderr
    pattern = r"decodert: error: the fp32 KV cache needs [\d.]+ GiB but only [\d.]+ GiB is available; export with"
    assert re.match(pattern, lines[0]) and re.match(pattern, generated.stderr.strip())
    number = r"[\d.]+ GiB is"  # the memory available differs between the two runs; the rest is the same line
    assert re.sub(number, "", lines[0]) == re.sub(number, "", generated.stderr.strip())


def _failing_llm():
    llm = make_llm()

    def allocate(slots):
        time.sleep(0.2)  # the others arrive while the first admission runs: one admission takes several
        raise DecodertError(TOO_BIG)

    llm.backend.allocate = allocate
    return llm


def test_a_failed_admission_fails_every_request_once_and_empties_the_queue():
    """6 clients at once: each gets a one-line 500 generation_failed within its timeout (before the fix, the
    requests admitted after the first failing one never answered and /health said "queued": 4 forever)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with running(_failing_llm(), model_name="tiny") as (url, app):
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=10), range(6)))
        for r in answers:
            err = r.json()["error"]
            assert r.status_code == 500 and err["code"] == "generation_failed", r.text
            assert err["message"] == f"generation failed: DecodertError: {TOO_BIG}"
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["queued"] == 0 and health["slots_in_use"] == 0
        assert app.state.engine.in_flight == 0 and app.state.engine.stats.failed == 6
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=10)
        datas = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert json.loads(datas[0])["error"]["code"] == "generation_failed" and datas[-1] == "[DONE]"


def test_a_run_that_cannot_start_fails_its_requests_instead_of_retrying():
    """A run that raises before it takes any request (here: the engine's run gate refuses) fails the waiting
    requests; before the fix the engine thread retried the same inbox forever at one core."""
    from decodert.runtime.engine.thread import EngineThread

    llm = make_llm()
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise DecodertError("this LLM is busy")

    llm.runs.stream = refuse
    worker = EngineThread(llm).start()
    events = []
    seq = worker.sequence(llm.prepare("hello", max_new_tokens=2))
    worker.submit(seq, events.append)
    deadline = time.time() + 5
    while not events and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert [e.error for e in events] == ["generation failed: DecodertError: this LLM is busy"]
    assert len(calls) == 1 and worker.in_flight == 0
    worker.stop()
