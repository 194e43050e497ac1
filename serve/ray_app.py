"""The same ASGI app on Ray Serve: N replicas (or autoscaled), each loading its own LLM and engine.

    decodert serve out/ --ray --replicas 2                      # a local Ray instance
    decodert serve out/ --ray --ray-address auto --min-replicas 1 --max-replicas 4
    serve run decodert.serve.ray_app:build artifact=/models/smollm2 replicas=2   # Ray's own CLI

Ray Serve's proxy routes each HTTP request to a replica (at most ``max_ongoing_requests`` at a
time per replica, the rest wait in the proxy); inside a replica the engine batches them as in
the single-process server. The artifact path must exist on every node that runs a replica.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from decodert.errors import DecodertError
from decodert.serve.server import ServeOptions, model_name

APP_NAME = "decodert"


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start a local Ray instance
    replicas: int = 1
    min_replicas: int | None = None  # autoscaling when min/max are given
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # default: the artifact's max batch
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0

    def check(self) -> None:
        if self.replicas < 1:
            raise DecodertError(f"--replicas must be >= 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise DecodertError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas or (self.max_replicas or 1) < 1:
            raise DecodertError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                                f"got {self.min_replicas} and {self.max_replicas}")
        if self.replica_cpus <= 0 or self.replica_gpus < 0:
            raise DecodertError("--replica-cpus must be > 0 and --replica-gpus >= 0")


class DecodertReplica:
    """One Ray Serve replica: loads the artifact and serves the app (engine started by its lifespan)."""

    def __init__(self, options: ServeOptions) -> None:
        from decodert.serve.server import make_app

        self._app = make_app(options)

    def __serve_build_asgi_app__(self):
        return self._app


def _slots(artifact: Path) -> int:
    """The artifact's max batch from its manifest (4 if the driver cannot read it)."""
    import json

    try:
        return int(json.loads((Path(artifact) / "manifest.json").read_text())["max_batch"])
    except (OSError, ValueError, KeyError, TypeError):
        return 4


def application(options: ServeOptions, ray: RayOptions):
    """The Ray Serve application (``Deployment.bind``) for these options."""
    from ray import serve

    ray.check()
    slots = _slots(options.artifact)
    config: dict[str, Any] = {
        "name": "DecodertReplica",
        "max_ongoing_requests": slots + options.max_queue,  # what one engine accepts before its own 429
        "ray_actor_options": {"num_cpus": ray.replica_cpus, "num_gpus": ray.replica_gpus},
        "graceful_shutdown_timeout_s": max(1.0, options.drain_s),
        "health_check_period_s": 10,
    }
    if ray.min_replicas is not None:
        config["autoscaling_config"] = {"min_replicas": ray.min_replicas, "max_replicas": ray.max_replicas,
                                        "target_ongoing_requests": ray.target_ongoing_requests or slots}
    else:
        config["num_replicas"] = ray.replicas
    deployment = serve.deployment(**config)(serve.ingress()(DecodertReplica))
    # the replicas see the Host clients sent to Ray's proxy: its address is this server's too
    return deployment.bind(replace(options, host="127.0.0.1", port=0,
                                   allowed_hosts=(*options.allowed_hosts, options.host)))


def build(args: Mapping[str, str]):
    """Application builder for Ray's CLI: ``serve run decodert.serve.ray_app:build artifact=PATH [replicas=N]
    [model_name=NAME] [api_key=KEY] [max_queue=N] [min_replicas=N max_replicas=N] [allowed_hosts=A,B]``."""
    if "artifact" not in args:
        raise DecodertError("serve run decodert.serve.ray_app:build needs artifact=PATH")
    opts = ServeOptions(Path(args["artifact"]), model_name=args.get("model_name"), api_key=args.get("api_key"),
                        max_queue=int(args.get("max_queue", 64)), backend=args.get("backend", "auto"),
                        prefix_cache_mb=float(args["prefix_cache_mb"]) if "prefix_cache_mb" in args else None,
                        allowed_hosts=tuple(h for h in args.get("allowed_hosts", "").split(",") if h))
    opts = replace(opts, model_name=model_name(opts))
    num = {k: int(args[k]) for k in ("replicas", "min_replicas", "max_replicas") if k in args}
    return application(opts, RayOptions(**num))


def run_on_ray(options: ServeOptions, ray_options: RayOptions) -> int:
    """Start (or join) Ray, deploy, print the address, and serve until SIGTERM/SIGINT; then shut Serve down."""
    ray_options.check()
    try:
        import ray
        from ray import serve
    except ImportError:
        raise DecodertError("`decodert serve --ray` needs Ray Serve: pip install 'decodert[ray]'") from None
    options = replace(options, model_name=model_name(options))
    ray.init(address=ray_options.address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(application(options, ray_options), name=APP_NAME, route_prefix="/")
        print(f"decodert: serving {options.model_name!r} on http://{options.host}:{options.port}/v1 through Ray Serve "
              f"({_describe(ray_options)}); Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)
        _wait_for_signal()
        serve.shutdown()
    finally:
        ray.shutdown()
    print("decodert: server stopped", file=sys.stderr, flush=True)
    return 0


def _describe(r: RayOptions) -> str:
    if r.min_replicas is not None:
        return f"autoscaling {r.min_replicas}..{r.max_replicas} replicas"
    return f"{r.replicas} replica{'s' if r.replicas != 1 else ''}"


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
