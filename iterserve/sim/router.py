"""Routers: which replica an arriving request goes to, when `simulate`/`plan` run several engines.

Replicas are independent engines; a router sees only what a load balancer in front of them could
(each replica's running + waiting count). The Ray Serve router's policies (issue 19) belong here too,
so that the simulator can plan for the router the deployment will use.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from iterserve.bench.workload import RequestSpec


class Replica(Protocol):
    @property
    def load(self) -> int: ...  # requests running or waiting


class Router:
    name = ""

    def route(self, spec: RequestSpec, replicas: Sequence[Replica]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def route(self, spec: RequestSpec, replicas: Sequence[Replica]) -> int:
        return next(self._next) % len(replicas)


class LeastLoaded(Router):
    """Fewest requests running or waiting (lowest index on ties)."""

    name = "least-loaded"

    def route(self, spec: RequestSpec, replicas: Sequence[Replica]) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].load)


ROUTERS: dict[str, Callable[[], Router]] = {"round-robin": RoundRobin, "least-loaded": LeastLoaded}
