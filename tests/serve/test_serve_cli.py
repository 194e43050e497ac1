"""`decodert serve` as a command: a subprocess on loopback, SIGTERM drains, flag errors, and Ray Serve (slow)."""

import json
import signal
import socket
import threading

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from serve_helpers import export_tiny, start_cli  # noqa: E402

from decodert.runtime.llm import LLM  # noqa: E402


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("serve-cli"), max_batch=2, max_seq=256)


def _sse(url, body, out, started):
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()


def test_sigterm_drains_the_stream_in_flight_then_exits(art):
    proc, url = start_cli(art, "--drain-timeout", "30")
    try:
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        out, started = [], threading.Event()
        body = {"model": "art", "prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0}
        reader = threading.Thread(target=_sse, args=(url, body, out, started))
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert out[-1] == "[DONE]" and json.loads(out[-2])["choices"][0]["finish_reason"] == "length"
    text = "".join(json.loads(d)["choices"][0]["text"] for d in out[:-1])
    assert text == LLM.load(art).generate(body["prompt"], max_new_tokens=200, temperature=0.0).text
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_api_key_from_the_environment(art):
    proc, url = start_cli(art, "--model-name", "mini", env={"DECODERT_API_KEY": "k1"})
    try:
        body = {"model": "mini", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_flag_errors_are_one_line(art, tmp_path, capsys):
    from decodert.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    cases = [((art, "--port", "70000"), "--port must be in 0..65535"), ((tmp_path / "nope",), "is not an artifact folder"),
             ((art, "--max-queue", "-1"), "--max-queue must be >= 0"), ((art, "--api-key", " "), "--api-key is empty"),
             ((art, "--port", str(taken.getsockname()[1])), "cannot listen on 127.0.0.1"),
             ((art, "--ray", "--replicas", "0"), "--replicas must be >= 1"),
             ((art, "--ray", "--min-replicas", "1"), "needs both --min-replicas and --max-replicas"),
             ((art, "--speculative", "draft"), "--speculative draft needs --draft"),
             ((art, "--prefix-cache-mb", "-1"), "--prefix-cache-mb must be >= 0"),
             ((art, "--client-timeout", "0"), "--client-timeout must be > 0"),
             ((art, "--tool-parser", "xml"), "--tool-parser: unknown tool parser 'xml'"),
             ((art, "--responses-store", "-1"), "--responses-store must be >= 0")]
    for args, message in cases:
        assert main(["serve", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("decodert: error: ") and message in err and len(err.strip().splitlines()) == 1, (args, err)
    taken.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ray_serve_two_replicas(art):
    """A local Ray instance, two replicas each with its own LLM: every answer equals offline, both replicas serve."""
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install .[ray]")
    from concurrent.futures import ThreadPoolExecutor

    port = _free_port()
    prompts = ["the quick brown fox", "hello world, a tiny", "numbers 12 345", "jumps over the lazy dog"] * 2
    llm = LLM.load(art)
    wants = [llm.generate(p, max_new_tokens=24, temperature=0.0).text for p in prompts]
    proc, url = start_cli(art, "--ray", "--replicas", "2", "--port", str(port), "--replica-cpus", "0.5",
                          pattern=r"on (http://127\.0\.0\.1:\d+)/v1 through Ray Serve", timeout=600)
    try:
        def ask(prompt):
            body = {"model": "art", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        with ThreadPoolExecutor(max_workers=4) as pool:
            assert list(pool.map(ask, prompts)) == wants
        pids = {httpx.get(f"{url}/health", timeout=30).json()["pid"] for _ in range(40)}
        assert len(pids) == 2, pids
        stream = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                            json={"model": "art", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                  "stream": True}).text
        assert stream.rstrip().endswith("data: [DONE]")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0


def test_ray_application_options(art):
    """What `--ray` asks Ray Serve for (no cluster needed to build the application)."""
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install .[ray]")
    from decodert.serve.ray_app import RayOptions, application, build
    from decodert.serve.server import ServeOptions

    opts = ServeOptions(art, model_name="m", max_queue=10, drain_s=5)
    fixed = application(opts, RayOptions(replicas=3, replica_gpus=1))._bound_deployment
    assert fixed.num_replicas == 3 and fixed.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1}
    assert fixed.max_ongoing_requests == 2 + 10  # the artifact's slots + the engine's queue
    auto = application(opts, RayOptions(min_replicas=1, max_replicas=4))._bound_deployment._deployment_config
    a = auto.autoscaling_config
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests) == (1, 4, 2)
    assert auto.graceful_shutdown_timeout_s == 5
    built = build({"artifact": str(art), "replicas": "2", "model_name": "x"})._bound_deployment
    assert built.num_replicas == 2 and built.init_args[0].model_name == "x"
