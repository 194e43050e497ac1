"""A real decodert server on loopback for the serve tests: uvicorn in a thread, or `decodert serve` in a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def export_tiny(root: Path, max_batch: int = 4, max_seq: int = 256) -> Path:
    """The fuzz samples' mini llama (no EOS: generation runs to max_tokens) exported for ort."""
    from fuzz_samples import make_hf

    from decodert.export.pipeline import export_model

    art = root / "art"
    export_model(make_hf(root / "hf"), art, target="ort", dtype="fp32", max_seq=max_seq, max_batch=max_batch,
                 progress=False)
    return art


@contextlib.contextmanager
def running(llm, model_name: str = "tiny", **config):
    """Serve ``llm`` on 127.0.0.1:<free port> in this process; yields (base_url, app)."""
    import uvicorn

    from decodert.runtime.engine.thread import EngineThread as Engine
    from decodert.serve.app import ServeConfig, build_app
    from decodert.serve.connections import http_protocol
    from decodert.serve.server import bind

    max_queue = config.pop("max_queue", 64)
    sndbuf = config.pop("sndbuf", None)  # SO_SNDBUF of the listening socket (accepted ones inherit it)
    app = build_app(Engine(llm, max_queue=max_queue), ServeConfig(model_name, **config))
    sock = bind("127.0.0.1", 0)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2,
                                           http=http_protocol(config.get("client_timeout_s", 30.0))))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def start_cli(art: Path, *args: str, env: dict | None = None, pattern: str = r"on (http://127\.0\.0\.1:\d+)/v1",
              timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`python -m decodert serve ART --port 0 ...` in a subprocess; returns (process, base_url)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "decodert", "serve", str(art), "--port", "0", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.time() + timeout
    for line in proc.stderr:
        found = re.search(pattern, line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining stderr
            return proc, found.group(1)
        if time.time() > deadline:
            break
    proc.kill()
    raise AssertionError(f"`decodert serve` did not start (exit {proc.wait()})")


# ---- the openai client's replies, streamed or whole, as one tuple to compare ----------------------------------------
def reassemble(chunks) -> tuple:
    """Stream chunks -> (content, reasoning, [(name, arguments)], finish_reason, ids), as the OpenAI SDK users do."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    ordered = [calls[k] for k in sorted(calls)]
    return (content or None, reasoning or None, [(c["name"], c["arguments"]) for c in ordered], finish,
            [c["id"] for c in ordered])


def whole(r) -> tuple:
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return (m.content, getattr(m, "reasoning_content", None), calls, r.choices[0].finish_reason,
            [c.id for c in m.tool_calls or []])
