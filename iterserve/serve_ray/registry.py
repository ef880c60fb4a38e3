"""The request routers alive in this process, by deployment name.

router.py registers each router here: a module of its own because Serve ships router.py by value, so
a registry there, or any global object it names, would be a copy. The ingress reads the replicas'
latest reports from it (live_router) for /health, /metrics, /v1/scheduler.
"""
from __future__ import annotations

_LIVE_ROUTERS: dict[str, object] = {}  # deployment name -> its request router in this process


def register_router(deployment: str, router: object) -> None:
    _LIVE_ROUTERS[deployment] = router


def live_router(deployment: str) -> object | None:
    return _LIVE_ROUTERS.get(deployment)
