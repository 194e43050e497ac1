"""``decodert serve ARTIFACT``: an OpenAI-compatible HTTP server (serve/), or N replicas on Ray Serve (--ray)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import Any

from decodert.cli import common
from decodert.errors import DecodertError
from decodert.runtime.vision.images import DEFAULT_LIMITS, ImageLimits
from decodert.runtime.warm import read_warm_file

API_KEY_ENV = "DECODERT_API_KEY"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve an exported model over an OpenAI-compatible HTTP API",
        description="POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages (Anthropic) "
                    "(streamed over SSE with stream: true), "
                    "GET /v1/models, /health and /metrics (Prometheus). One engine thread batches the requests "
                    "of every client; SIGTERM drains them (see docs/SERVING.md).")
    p.add_argument("artifact", metavar="MODEL", type=Path, help=common.MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port, printed)")
    p.add_argument("--model-name", help="the model id clients send (default: the model name, file stem or folder name given)")
    p.add_argument("--served-model-name", default=None, metavar="NAME[,NAME...]",
                   help="the model's names, comma-separated: the first replaces --model-name, the others are aliases; "
                        "all are listed in /v1/models and accepted")
    p.add_argument("--accept-any-model", action="store_true",
                   help="accept any model name in requests as this model (for clients that hard-code one)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="a PEFT LoRA adapter served as model 'MODEL:NAME' (or 'NAME'), repeatable; the artifact must be "
                        "exported with --lora-slots (as vLLM's --lora-modules)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/* (default: ${API_KEY_ENV} if set)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a free slot; beyond that the server answers 429 (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish before they are cancelled (default 30)")
    p.add_argument("--client-timeout", type=float, default=30.0,
                   help="seconds a request's headers may take to arrive (then the connection is closed), its body "
                        "(then 408), and a stream reader may take no bytes before it is dropped (slow clients; default 30)")
    p.add_argument("--allowed-hosts", default="", metavar="HOST[,HOST...]",
                   help="Host header names to accept besides 127.0.0.1, localhost, [::1] and the address listened on "
                        "(e.g. the name a proxy or clients use; '*' = any); others get 421 (DNS-rebinding protection)")
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN[,ORIGIN...]",
                   help="web origins (scheme://host[:port]) browsers may call the API from (CORS; '*' = any); "
                        "default none: preflights are refused")
    p.add_argument("--backend", choices=("auto", "ort", "trt"), default="auto", help="execution backend")
    common.add_placement(p)
    p.add_argument("--full-verify", dest="verify", action="store_const", const="full", default="fast",
                   help="check the whole sha256 of every artifact file at load")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="prefix cache budget in MiB: prompts that start like an earlier one reuse its K/V "
                        "(default: room for two full contexts; 0 = off)")
    p.add_argument("--warm", type=Path, default=None, metavar="FILE",
                   help="prefill these prompts into the prefix cache before listening, so the first request that starts "
                        "like one is a hit: a JSON array, or FILE.jsonl one entry a line; an entry is a prompt string, "
                        "a list of chat messages (rendered with the chat template as a chat request is), or "
                        "{\"messages\": [...], \"tools\": [...]} (also enable_thinking, chat_template_kwargs, adapter); "
                        "a bad entry or one that does not fit the cache is an error (docs/features/persistence.md)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="keep the prefix cache's blocks in DIR too (e.g. $DECODERT_CACHE/prefix): a restarted server "
                        "on the same artifact starts with them (docs/features/persistence.md)")
    p.add_argument("--cache-dir-gb", type=float, default=None, metavar="N",
                   help="most GB the blocks may take in --cache-dir, least recently used deleted first (default 4)")
    common.add_speculative(p, help="speculative decoding for every request that does not set its own 'speculative' "
                                   "(ngram: prompt lookup; draft: a draft model, --draft)")
    p.add_argument("--responses-store", type=int, default=256, metavar="N",
                   help="/v1/responses created with store: true that are kept for previous_response_id and GET "
                        "(in memory, least recently used dropped first; default 256; 0 = none)")
    p.add_argument("--tool-parser", default=None, metavar="FORMAT",
                   help="tool-call format: hermes, llama3, mistral or phi4 (default: the one the chat template writes)")
    v = p.add_argument_group("images (vision-language models)")
    v.add_argument("--allow-image-urls", action="store_true",
                   help="fetch remote http(s) image_url parts (default: refused; only data: URLs are read)")
    v.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds one remote image may take in all: connect, redirects and body (default 10)")
    v.add_argument("--max-image-fetches", type=int, default=8,
                   help="remote images fetched at once, server-wide; one more request gets 503 (default 8)")
    v.add_argument("--max-image-bytes", type=int, default=DEFAULT_LIMITS.max_bytes, help="largest encoded image")
    v.add_argument("--max-image-pixels", type=int, default=DEFAULT_LIMITS.max_pixels,
                   help="most pixels (width x height) of one image, checked before decoding")
    v.add_argument("--max-images", type=int, default=DEFAULT_LIMITS.max_images, help="most images per request")
    v.add_argument("--max-video-frames", type=int, default=DEFAULT_LIMITS.max_frames,
                   help="most video frames per request (video_url parts: lists of frame data URLs)")
    v.add_argument("--max-video-pixels", type=int, default=DEFAULT_LIMITS.max_video_pixels,
                   help="most pixels over all video frames of a request")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="warning",
                   help="the HTTP server's log level on stderr (default warning; info logs every request)")
    r = p.add_argument_group("Ray Serve (pip install .[ray]; docs/SERVING.md)")
    r.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead: replicas each own an LLM")
    r.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local Ray instance)")
    r.add_argument("--replicas", type=int, default=1, help="fixed number of replicas (default 1)")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (with --max-replicas)")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    r.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests per replica to aim for (default: the artifact's max batch)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica (default 0; 1 for trt)")
    p.set_defaults(func=run_serve)


def options(args: argparse.Namespace):
    """Checked ServeOptions from the parsed arguments (DecodertError naming the flag)."""
    from decodert.serve.server import ServeOptions

    if not 0 <= args.port <= 65535:
        raise DecodertError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise DecodertError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise DecodertError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if not args.drain_timeout >= 0:
        raise DecodertError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.client_timeout > 0:
        raise DecodertError(f"--client-timeout must be > 0 seconds, got {args.client_timeout}")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():  # the flag and the variable alike: never a silently open server
        raise DecodertError(f"--api-key is empty (or ${API_KEY_ENV} is set but empty); give a key, or unset both")
    if args.prefix_cache_mb is not None and not args.prefix_cache_mb >= 0:
        raise DecodertError(f"--prefix-cache-mb must be >= 0 (0 = off), got {args.prefix_cache_mb}")
    _check_ranges(args)
    if args.cache_dir_gb is not None and args.cache_dir is None:
        raise DecodertError("--cache-dir-gb is the budget of --cache-dir: give --cache-dir DIR too")
    if args.cache_dir is not None and args.prefix_cache_mb == 0:
        raise DecodertError("--cache-dir keeps the prefix cache's blocks on disk, and --prefix-cache-mb 0 turns that cache off")
    if args.tool_parser is not None:
        from decodert.runtime.chat.tool_calls import tool_format

        try:
            tool_format(None, args.tool_parser)
        except DecodertError as e:
            raise DecodertError(f"--tool-parser: {e}") from None
    if args.warm is not None and args.prefix_cache_mb == 0:
        raise DecodertError("--warm fills the prefix cache, which --prefix-cache-mb 0 turns off")
    warm = read_warm_file(args.warm) if args.warm is not None else ()  # a bad entry fails before the model loads
    speculative = common.speculative_kwargs(args).get("speculative")  # a SpeculativeConfig or None
    artifact = common.artifact_of(args.artifact)  # 'smollm2', a .gguf or an HF folder: exported once into the cache
    if not artifact.is_dir():
        raise DecodertError(f"{args.artifact} is not an artifact folder (written by `decodert export`) nor a model "
                            f"`decodert run` takes ('smollm2', a .gguf file, an HF folder)")
    names = _names(args.served_model_name, args.model_name)
    name = names[0] if names else (Path(args.artifact).stem if artifact != args.artifact else None)
    draft = common.artifact_of(args.draft) if args.draft is not None else None
    return ServeOptions(artifact, args.host, args.port, name, key, args.max_queue, args.max_body_bytes,
                        args.drain_timeout, args.backend, args.verify, args.log_level, speculative, draft,
                        args.prefix_cache_mb, args.client_timeout, _hosts(args.allowed_hosts), args.tool_parser,
                        _loras(args.lora),
                        image_limits=ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images,
                                                 args.max_video_frames, args.max_video_pixels),
                        allow_image_urls=args.allow_image_urls, responses_store=args.responses_store,
                        aliases=tuple(names[1:]), placement=args.placement,
                        accept_any_model=args.accept_any_model, allowed_origins=_origins(args.allowed_origins),
                        image_fetch_timeout_s=args.image_fetch_timeout, max_image_fetches=args.max_image_fetches,
                        warm=tuple(warm),
                        cache_dir=args.cache_dir, cache_dir_gb=args.cache_dir_gb)


# every other numeric flag's lowest value (None: not given); floats must also be finite
_LOWEST = {"max_image_fetches": 1, "max_image_bytes": 1, "max_image_pixels": 1, "max_images": 0, "max_video_frames": 0,
           "max_video_pixels": 1, "replicas": 1, "min_replicas": 0, "max_replicas": 1,
           "responses_store": 0}
_FLOATS = {"image_fetch_timeout": 0.0, "drain_timeout": 0.0, "client_timeout": 0.0, "prefix_cache_mb": 0.0,
           "cache_dir_gb": 0.0, "target_ongoing_requests": 0.0,
           "replica_cpus": 0.0, "replica_gpus": 0.0}
_ABOVE = {"image_fetch_timeout", "client_timeout", "cache_dir_gb", "target_ongoing_requests",
          "replica_cpus"}  # must be above their lowest, not at it


def _check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, one line naming it (``--max-images -1``, ``--max-image-pixels 0``,
    ``--drain-timeout inf`` used to start a server that refused every image, or to fail at shutdown)."""
    for name, low in _LOWEST.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise DecodertError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name, low in _FLOATS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag, above = f"--{name.replace('_', '-')}", name in _ABOVE
        if not math.isfinite(value) or value < low or (above and value == low):
            raise DecodertError(f"{flag} must be a finite number {'>' if above else '>='} {low:g}, got {value}")


def _loras(values: list[str]) -> tuple[tuple[str, Path], ...]:
    """--lora NAME=DIR values -> ((name, folder), ...); a malformed or repeated one names the flag."""
    out: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name.strip() or not folder.strip() or ":" in name:
            raise DecodertError(f"--lora {value!r}: expected NAME=DIR (a name without ':', a PEFT adapter folder)")
        if name in out:
            raise DecodertError(f"--lora: the name {name!r} is given twice")
        out[name] = Path(folder)
    return tuple(out.items())


def run_serve(args: argparse.Namespace) -> int:
    opts = options(args)
    if opts.api_key is None and not _loopback(opts.host):
        print(f"decodert: warning: listening on {opts.host} without an API key (--api-key or ${API_KEY_ENV})",
              file=sys.stderr)
    if args.ray:
        from decodert.serve.ray_app import RayOptions, run_on_ray

        return run_on_ray(opts, RayOptions(args.ray_address, args.replicas, args.min_replicas, args.max_replicas,
                                           args.target_ongoing_requests, args.replica_cpus, args.replica_gpus))
    _check_serve_extra()
    from decodert.serve.server import serve

    return serve(opts)


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    bad = next((h for h in hosts if any(c in h for c in " /@?#")), None)
    if bad is not None:
        raise DecodertError(f"--allowed-hosts takes host names or name:port, comma-separated, got {bad!r}")
    return hosts


def _names(served: str | None, model_name: str | None) -> list[str]:
    """--served-model-name A,B,C (or --model-name A) -> the names, the first the main one."""
    if served is None:
        return [model_name] if model_name else []
    if model_name is not None:
        raise DecodertError("give --model-name or --served-model-name, not both")
    names = [n.strip() for n in served.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise DecodertError(f"--served-model-name takes distinct non-empty names, comma-separated, got {served!r}")
    return names


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins values: '*' or origins as browsers send them (scheme://host[:port], no path)."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        scheme, sep, rest = o.partition("://")
        if o != "*" and (not sep or scheme not in ("http", "https") or not rest or any(c in rest for c in " /?#@")):
            raise DecodertError(f"--allowed-origins takes '*' or origins like https://app.example:8443, comma-separated, "
                                f"got {o!r}")
    return origins


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_serve_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client") if not _importable(m)]
    if missing:
        raise DecodertError(f"`decodert serve` needs {', '.join(missing)}: pip install 'decodert[serve]'")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
