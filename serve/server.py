"""Run the app on uvicorn: bind (127.0.0.1 unless told otherwise), serve, and on SIGTERM/SIGINT drain.

Shutdown order: uvicorn stops accepting connections and waits up to ``drain_s`` for the requests
in flight (streams run to their end); then the app's lifespan stops the engine, which cancels
whatever is still running; the process exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decodert.errors import DecodertError
from decodert.runtime.vision.fetch import Fetcher
from decodert.runtime.vision.images import DEFAULT_LIMITS, ImageLimits


@dataclass(frozen=True)
class ServeOptions:
    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 4 << 20
    drain_s: float = 30.0
    backend: str = "auto"
    verify: str = "fast"
    log_level: str = "warning"
    speculative: Any = None  # default speculative decoding: "ngram" | "draft" | a SpeculativeConfig (requests may override)
    draft: Path | None = None  # the draft model's artifact (speculative "draft")
    prefix_cache_mb: float | None = None  # prefix cache budget in MiB (None: LLM.load's default; 0: off)
    client_timeout_s: float = 30.0  # slow clients: header and body arrival deadline, stream write timeout
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides loopback and the bound address
    tool_parser: str | None = None  # tool-call format (runtime/chat/tool_calls.py); None: from the chat template
    lora: tuple[tuple[str, Path], ...] = ()  # (name, PEFT folder): served as model "NAME:adapter" (--lora)
    image_limits: ImageLimits = DEFAULT_LIMITS  # bytes, pixels and images per request (runtime/vision/images.py)
    allow_image_urls: bool = False  # fetch remote http(s) image_url parts (off: an open fetcher is an SSRF hole)
    responses_store: int = 256  # /v1/responses kept for previous_response_id (store: true), LRU; 0: none
    aliases: tuple[str, ...] = ()  # more names of the model (--served-model-name A B ...: the names after the first)
    accept_any_model: bool = False  # any model name means the served model (--accept-any-model)
    allowed_origins: tuple[str, ...] = ()  # CORS: web origins allowed to call the API (--allowed-origins; "*": any)
    image_fetch_timeout_s: float = 10.0  # the whole of one image fetch (runtime/vision/fetch.py)
    max_image_fetches: int = 8  # image fetches at once, server-wide (one more: 503)
    warm: tuple = ()  # prompts prefilled into the prefix cache before listening (--warm: runtime/warm.py entries)
    cache_dir: Path | None = None  # the prefix cache's disk tier (--cache-dir; runtime/persist/disk_tier.py)
    cache_dir_gb: float | None = None  # its budget in GB (None: 4)
    placement: Any = "auto"  # which backend runs each phase (runtime/backends/placement.py; --placement)


def model_name(options: ServeOptions) -> str:
    return options.model_name or Path(options.artifact).resolve().name


def make_app(options: ServeOptions):
    """Load the artifact and build the app (the engine starts with the app's lifespan)."""
    from decodert.api import LLM  # an artifact folder, or a checkpoint exported once into the cache
    from decodert.runtime.engine.thread import EngineThread
    from decodert.serve.app import ServeConfig, build_app
    from decodert.serve.models import created_time

    llm = LLM.load(options.artifact, backend=options.backend, verify=options.verify, draft=options.draft,
                   prefix_cache_mb=options.prefix_cache_mb, tool_parser=options.tool_parser,
                   adapters=dict(options.lora) or None, cache_dir=options.cache_dir, cache_dir_gb=options.cache_dir_gb,
                   placement=options.placement)
    llm.image_limits = options.image_limits
    if options.allow_image_urls:
        llm.fetch_image = Fetcher(options.image_limits, options.image_fetch_timeout_s, options.max_image_fetches)
    engine = EngineThread(llm, max_queue=options.max_queue)
    try:
        engine.speculation(options.speculative)  # a default the model cannot do fails now, not per request
    except DecodertError as e:
        method = getattr(options.speculative, "method", options.speculative)
        raise DecodertError(f"--speculative {method}: {e}") from None
    llm.engine.reserve()  # a shared cache that cannot be allocated is refused now (exit 2), not at the first request
    if options.warm:  # before the server says it is ready: the first request is already a hit
        held = llm.warm(options.warm)
        print(f"decodert: warmed {len(held)} prompts into the prefix cache ({sum(held)} tokens)", file=sys.stderr,
              flush=True)
    config = ServeConfig(model_name(options), options.api_key, options.max_body_bytes, options.drain_s,
                         options.speculative, options.client_timeout_s, options.allowed_hosts,
                         responses_store=options.responses_store,
                         aliases=options.aliases, accept_any_model=options.accept_any_model,
                         created=created_time(options.artifact, llm.manifest), allowed_origins=options.allowed_origins)
    return build_app(engine, config)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); DecodertError naming --host/--port on failure."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DecodertError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise DecodertError(f"cannot listen on {host}:{port}: {e.strerror} (--host/--port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; print the address (with the real port when --port 0) first."""
    import uvicorn

    from decodert.serve.connections import http_protocol

    sock = bind(options.host, options.port)  # a taken port fails before the model loads
    app = make_app(options)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    config = uvicorn.Config(app, log_level=options.log_level, timeout_graceful_shutdown=max(1, int(options.drain_s)),
                            lifespan="on", access_log=False,  # requests are logged by serve/guard.py, at info
                            http=http_protocol(options.client_timeout_s))
    server = uvicorn.Server(config)
    print(f"decodert: serving {app.state.config.model_name!r} on http://{shown}:{port}/v1 "
          f"({app.state.engine.slots} slots, queue {options.max_queue}); Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM/SIGINT while it runs, then re-raises the signal under the handler it
    # found: a no-op one here, so a drained server exits 0 instead of dying of the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    prefix = app.state.engine.llm.prefix_cache
    if getattr(prefix, "disk", None) is not None:
        prefix.disk.close()  # the blocks still queued are written for the next start
    print("decodert: server stopped", file=sys.stderr, flush=True)
    return 0
