"""Ingress: the OpenAI-compatible API (server/api.py's build_api, unchanged) over the engine replicas.

Requests are validated, tokenised and formatted here by OpenAIServing, exactly as in the
single-process server; RemoteEngine sends each one to a replica. /health, /metrics and /v1/scheduler
are the ingress's own: they answer for every replica from its latest report (the routing stats each
replica pushes every stats period), each replica's series labelled replica="<id>". So do /dashboard
and /v1/scheduler/stream: the single server's page and hub over the replicas' ticks
(dashboard_feed.py), one panel per replica.
"""
from __future__ import annotations

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

from iterserve.serve_ray.dashboard_feed import ReplicaTicks
from iterserve.serve_ray.remote_engine import RemoteEngine
from iterserve.serve_ray.registry import live_router
from iterserve.server.api import build_api
from iterserve.server.dashboard import SchedulerStream, add_dashboard
from iterserve.server.middleware import error_response
from iterserve.server.serving import OpenAIServing, ServerSettings

log = logging.getLogger("iterserve.serve_ray")


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
        "speculative": _aggregate_speculative(states),
        "memory": _aggregate_memory(states),
        "config": {**first.get("config", {}), "replicas": len(states), "router": router},
        "steps": steps,
        "replicas": [{k: v for k, v in s.items() if k != "steps"} for s in states],
    }


def _aggregate_memory(states: list[dict]) -> dict | None:
    """The replicas' memory (memory.MemoryReport) on this deployment: private weights, KV caches and
    workspaces summed; mapped weights once, the largest replica's, since replicas serving one file share
    its pages (a GGUF's blocks are read in place from the map); available memory the least seen."""
    mems = [s["memory"] for s in states if s.get("memory")]
    if not mems:
        return None
    total = lambda key: sum(m.get(key) or 0 for m in mems)  # noqa: E731
    available = [m["available"] for m in mems if m.get("available") is not None]
    return {"weights_resident": total("weights_resident"), "weights_mapped": max(m.get("weights_mapped") or 0
                                                                                 for m in mems),
            "kv_cache": total("kv_cache"), "workspace_estimate": total("workspace_estimate"),
            "available": min(available) if available else None, "replicas": len(mems)}


def _aggregate_speculative(states: list[dict]) -> dict:
    """The replicas' speculative totals summed, their rates taken over the sums."""
    specs = [s.get("speculative") or {} for s in states]
    per_pos: list[int] = []
    for sp in specs:
        for i, n in enumerate(sp.get("accepted_per_pos") or []):
            per_pos.extend([0] * (i + 1 - len(per_pos)))
            per_pos[i] += n
    drafts, draft_tokens, accepted = (sum(sp.get(k) or 0 for sp in specs)
                                      for k in ("num_drafts", "draft_tokens", "accepted_tokens"))
    return {"config": specs[0].get("config") if specs else None, "num_drafts": drafts,
            "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None, "accepted_per_pos": per_pos}


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

    def reports() -> dict[str, dict]:
        """Each replica's latest report (routing stats, at most stats_period_s old)."""
        router = live_router(deployment_name)
        return {rid: rep for rid, rep in sorted(router.reports().items()) if "scheduler" in rep} if router else {}

    add_dashboard(app, SchedulerStream(ReplicaTicks(reports, lambda: remote.shutting_down)))

    @app.get("/health")
    async def health():
        if not any(rep.get("ready") for rep in reports().values()):
            return error_response("no engine replica is ready (yet)", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        texts = {rid: rep["metrics"] for rid, rep in reports().items()}
        texts["ingress"] = generate_latest(registry).decode()
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/scheduler")
    async def scheduler(since_step: int | None = Query(None, ge=0, description="only steps after this one "
                                                          "(each replica numbers its own)")):
        states = []
        for rep in reports().values():
            state = dict(rep["scheduler"])
            if since_step is not None:
                state["steps"] = [st for st in state["steps"] if st["step"] > since_step]
            states.append(state)
        return aggregate_scheduler(states, router)

    return app


@serve.ingress()
class Ingress:
    """The ingress deployment; its FastAPI app is built once the replicas' limits are known."""

    def __init__(self, replicas: DeploymentHandle, settings: ServerSettings, router: str,
                 max_retries: int = 1) -> None:
        self.replicas, self.settings, self.router, self.max_retries = replicas, settings, router, max_retries

    async def __serve_build_asgi_app__(self) -> FastAPI:
        # every handle derived from self.replicas (a method's, a stream's) shares its one router, and
        # so the routing policy's memory: Serve initialises a handle before deriving one from it
        info = await self.replicas.describe.remote()
        remote = RemoteEngine(self.replicas, info, self.max_retries)
        return build_ingress_app(remote, self.settings, self.replicas, self.replicas.deployment_id.name, self.router)
