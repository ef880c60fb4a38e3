"""Which simulated replica an arriving request goes to: the deployment's own routing policy.

`simulate`/`plan` with several replicas route with `iterserve.routing.RoutingPolicy`, the very policy
the Ray Serve ingress runs (serve_ray/router.py), so a plan predicts the router it will be deployed
behind: round-robin, least-loaded, or prefix (the deployment's default). This module only feeds it
what the ingress would: before each choice, every replica's running + waiting count (reported
exactly, as if routing stats were fresh, so nothing counts as in transit); the prompt's block hashes
at the engines' block size; and, after the choice, that the request went there. KV usage is not
reported, so ties (equal load) go to the replica remembering fewer blocks, then the lower index.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from iterserve.routing import ReplicaLoad, RouterConfig, RoutingPolicy


class Replica(Protocol):
    @property
    def load(self) -> int: ...  # requests running or waiting (reported as running: the policy sums them)


class Router:
    """RoutingPolicy over replicas numbered 0..n-1 (their ids are str(index))."""

    def __init__(self, config: RouterConfig) -> None:
        self.policy = RoutingPolicy(config)
        self.name = config.policy

    def route(self, ids: list[int], replicas: Sequence[Replica]) -> int:
        """The replica for a prompt of token ids `ids`, recorded as sent there."""
        policy = self.policy
        names = [str(i) for i in range(len(replicas))]
        if len(policy.replicas) != len(names):
            policy.update_replicas(names)
        for name, replica in zip(names, replicas):
            routed = policy.replicas[name].routed_total
            policy.report(name, ReplicaLoad(running=replica.load, received_total=routed))
        hashes = policy.block_hashes(ids)
        chosen = policy.rank(names, hashes)[0][0]
        policy.routed(chosen, hashes)
        return int(chosen)


def make_router(name: str, block_size: int = RouterConfig.block_size, **config: int) -> Router:
    """A router by policy name (`--router`); block_size must be the engines' (hashes are per full block)."""
    return Router(RouterConfig(policy=name, block_size=block_size, **config))

