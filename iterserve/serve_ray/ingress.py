"""Ingress: the OpenAI-compatible API (server/api.py's build_api, unchanged) over the engine replicas.

Requests are validated, tokenised and formatted here by OpenAIServing, exactly as in the
single-process server; RemoteEngine sends each one to a replica. /health, /metrics and /v1/scheduler
are the ingress's own: they ask every replica (through the router, pinned with target_replica) and
answer for all of them, each replica's series labelled replica="<id>".
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Query
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.handle import DeploymentHandle

from iterserve.serve_ray.remote_engine import RemoteEngine
from iterserve.serve_ray.policy import live_policy
from iterserve.server.api import build_api
from iterserve.server.middleware import error_response
from iterserve.server.serving import OpenAIServing, ServerSettings

log = logging.getLogger("iterserve.serve_ray")
REPLICA_CALL_TIMEOUT_S = 10.0  # a replica that does not answer a stats call in this time is left out


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus texts of several processes as one exposition: a family once, its samples from all,
    each labelled replica=<name>."""
    families: dict[str, object] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            into = families.setdefault(fam.name, fam)
            samples = [s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
            if into is fam:
                fam.samples = samples
            else:
                into.samples.extend(samples)

    class Merged:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


def aggregate_scheduler(states: list[dict], router: str) -> dict:
    """One engine's /v1/scheduler shape summed over replicas (so tools that read it work unchanged),
    plus `replicas`: each replica's own answer without its step records. Steps are every replica's,
    tagged with it and ordered by time; their numbers are per replica."""
    total = lambda *path: sum(_get(s, path) or 0 for s in states)  # noqa: E731
    queries, hits = total("prefix_cache", "queries"), total("prefix_cache", "hits")
    used, blocks = total("kv_cache", "used_blocks"), total("kv_cache", "total_blocks")
    steps = sorted(({**st, "replica": s["replica"]} for s in states for st in s.get("steps", [])),
                   key=lambda st: st["t"])
    first = states[0] if states else {}
    return {
        "batching": first.get("batching"), "running": total("running"), "waiting": total("waiting"),
        "kv_cache": {"used_blocks": used, "total_blocks": blocks, "usage": used / blocks if blocks else 0.0,
                     "tokens_stored": total("kv_cache", "tokens_stored"),
                     "internal_fragmentation": max((_get(s, ("kv_cache", "internal_fragmentation")) or 0
                                                    for s in states), default=0.0)},
        "busy_fraction": sum(s["busy_fraction"] for s in states) / len(states) if states else 0.0,
        "uptime_s": max((s["uptime_s"] for s in states), default=0.0),
        "step": total("step"), "num_preemptions_total": total("num_preemptions_total"),
        "num_recomputed_tokens_total": total("num_recomputed_tokens_total"),
        "prefix_cache": {"enabled": bool(_get(first, ("prefix_cache", "enabled"))), "queries": queries,
                         "hits": hits, "hit_rate": hits / queries if queries else None,
                         "cached_free_blocks": total("prefix_cache", "cached_free_blocks")},
        "config": {**first.get("config", {}), "replicas": len(states), "router": router},
        "steps": steps,
        "replicas": [{k: v for k, v in s.items() if k != "steps"} for s in states],
    }


def _get(d: dict, path: tuple[str, ...]):
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def build_ingress_app(remote: RemoteEngine, settings: ServerSettings, replicas: DeploymentHandle,
                      deployment_name: str, router: str) -> FastAPI:
    registry = CollectorRegistry()
    rejected = Counter("iterserve:request_rejected", "Requests refused before admission, by HTTP status.",
                       ["model_name", "status_code"], registry=registry)

    def on_rejected(status_code: int) -> None:
        rejected.labels(settings.served_model_name, str(status_code)).inc()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with anyio.create_task_group():
            pass
        yield
        remote.shutting_down = True

    app = build_api(OpenAIServing(remote, settings), settings, on_rejected, lifespan)
    app.state.engine = remote

    async def each_replica(method: str, **kwargs) -> list:
        """method's answer from every replica that answers in time (a dead one is left out)."""
        policy = live_policy(deployment_name)
        ids = sorted(policy.replicas) if policy is not None else []
        calls = [asyncio.wait_for(getattr(replicas, method).remote(target_replica=rid, **kwargs),
                                  REPLICA_CALL_TIMEOUT_S) for rid in ids]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        for rid, a in zip(ids, answers):
            if isinstance(a, BaseException):
                log.warning("replica %s did not answer %s: %r", rid, method, a)
        return [a for a in answers if not isinstance(a, BaseException)]

    @app.get("/health")
    async def health():
        ready = [r for r in await each_replica("ready") if r]
        if not ready:
            return error_response("no engine replica is ready (yet)", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        texts = dict(await each_replica("metrics_text"))
        texts["ingress"] = generate_latest(registry).decode()
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/scheduler")
    async def scheduler(since_step: int | None = Query(None, ge=0, description="only steps after this one "
                                                          "(each replica numbers its own)")):
        states = sorted(await each_replica("scheduler", since_step=since_step), key=lambda s: s["replica"])
        return aggregate_scheduler(states, router)

    return app


@serve.ingress()
class Ingress:
    """The ingress deployment; its FastAPI app is built once the replicas' limits are known."""

    def __init__(self, replicas: DeploymentHandle, settings: ServerSettings, router: str,
                 max_retries: int = 1) -> None:
        self.replicas, self.settings, self.router, self.max_retries = replicas, settings, router, max_retries

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # Initialise the handle before deriving method/stream handles from it, so that they all share
        # its one router (and the routing policy's memory); a derived handle of an uninitialised one
        # would create a router of its own
        if not self.replicas.is_initialized:
            self.replicas._init()
        info = await self.replicas.describe.remote()
        remote = RemoteEngine(self.replicas, info, self.max_retries)
        return build_ingress_app(remote, self.settings, self.replicas, self.replicas.deployment_id.name, self.router)
