"""The Serve application of `iterserve serve --replicas N`, and running it on a local or existing cluster.

Resources: each replica reserves `threads_per_replica` CPUs and runs torch with that many threads,
so replicas on one machine never oversubscribe its cores (default: this machine's cores split
evenly); on CUDA each replica also reserves one GPU. The ingress reserves no CPU of its own.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass, field

import ray
import torch
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

from iterserve.config import EngineConfig
from iterserve.serve_ray.ingress import Ingress
from iterserve.routing import RouterConfig
from iterserve.serve_ray.replica import EngineReplica
from iterserve.serve_ray.router import IterserveRequestRouter
from iterserve.server.serving import ServerSettings

log = logging.getLogger("iterserve.serve_ray")
APP_NAME = "iterserve"
REPLICA_DEPLOYMENT = "EngineReplica"


# A local cluster started by `serve --replicas`: no dashboard; a small object store (only token ids
# and outputs travel); and workers at normal priority. Ray starts its workers at nice 15 by default
# (its daemons first), but here the workers are the server: replicas, ingress, HTTP proxy; niced,
# they would yield the cores to anything else on the machine that a single-process server would not.
LOCAL_CLUSTER = {"include_dashboard": False, "object_store_memory": 256 * 2**20,
                 "_system_config": {"worker_niceness": 0}}


@dataclass
class ScaleOutConfig:
    """Every switch of the scale-out (the engine's are in EngineConfig, the HTTP layer's in ServerSettings)."""

    replicas: int = 2
    threads_per_replica: int | None = None  # None: this machine's cores // replicas (at least 1)
    router: RouterConfig = field(default_factory=RouterConfig)
    max_ongoing_requests: int = 256  # per replica, Serve's admission bound; --max-waiting is the engine's
    stats_period_s: float = 0.2  # how often replicas report their load to the router
    max_retries: int = 1  # re-sends of a request whose replica died before it produced output
    stream_interval_s: float = 0.05  # replicas send a request's outputs at most this often (the first at once)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError("--threads-per-replica must be >= 1")
        if self.stream_interval_s < 0:
            raise ValueError("--stream-interval must be >= 0")

    def threads(self) -> int:
        return self.threads_per_replica or max(1, (os.cpu_count() or 1) // self.replicas)


def uses_cuda(config: EngineConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def math_env(threads: int) -> dict[str, str]:
    """A replica's OpenMP threads: as many as it reserved, sleeping when idle instead of spinning
    (a spinning thread takes a core from the other replicas and Ray's processes)."""
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def build_application(engine_config: EngineConfig, settings: ServerSettings, scale: ScaleOutConfig):
    threads = scale.threads()
    engine_config = dataclasses.replace(engine_config, num_threads=threads)
    router = dataclasses.replace(scale.router, block_size=engine_config.block_size)
    replica = serve.deployment(
        EngineReplica, name=REPLICA_DEPLOYMENT, num_replicas=scale.replicas,
        max_ongoing_requests=scale.max_ongoing_requests, health_check_period_s=2, health_check_timeout_s=30,
        ray_actor_options={"num_cpus": threads, "num_gpus": 1 if uses_cuda(engine_config) else 0,
                           "runtime_env": {"env_vars": math_env(threads)}},
        request_router_config=RequestRouterConfig(
            request_router_class=IterserveRequestRouter,
            request_router_kwargs={"deployment": REPLICA_DEPLOYMENT, **dataclasses.asdict(router)},
            request_routing_stats_period_s=scale.stats_period_s, request_routing_stats_timeout_s=5))
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": math_env(1)}})
    return ingress.bind(replica.bind(engine_config, settings, scale.stream_interval_s), settings, router.policy, scale.max_retries)


def start(engine_config: EngineConfig, settings: ServerSettings, scale: ScaleOutConfig, host: str, port: int,
          ray_address: str | None = None, ray_init: dict | None = None) -> None:
    """Starts (or joins, with ray_address) a Ray cluster and runs the application; returns once it is up."""
    if not ray.is_initialized():
        ray.init(address=ray_address, **(ray_init or {}))
    serve.start(http_options=HTTPOptions(host=host, port=port))
    serve.run(build_application(engine_config, settings, scale), name=APP_NAME, route_prefix="/")


def run_until_signal(engine_config: EngineConfig, settings: ServerSettings, scale: ScaleOutConfig, host: str,
                     port: int, ray_address: str | None = None) -> int:
    """`iterserve serve --replicas N`: runs until SIGINT/SIGTERM, then deletes the application (a local
    cluster it started goes with it)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray_init = {} if ray_address else LOCAL_CLUSTER
    start(engine_config, settings, scale, host, port, ray_address, ray_init)
    log.info("serving %d replica(s) of %s on http://%s:%d (router %s, %d thread(s) each)", scale.replicas,
             engine_config.model, host, port, scale.router.policy, scale.threads())
    stop.wait()
    serve.delete(APP_NAME)
    if not ray_address:
        serve.shutdown()
        ray.shutdown()
    return 0
