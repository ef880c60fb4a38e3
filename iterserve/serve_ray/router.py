"""IterserveRequestRouter: Ray Serve's RequestRouter running routing.RoutingPolicy in the ingress.

Serve instantiates the router inside each handle's process (the ingress) and asks it to rank the
candidate replicas for every call. A `generate` call is ranked by the policy from its prompt's block
hashes (computed once per request). Replicas' load, and the state the ingress shows per replica,
arrive through Serve's routing stats (EngineReplica.record_routing_stats). Each router registers
itself with registry.register_router (a function of another module: Serve ships this module by value,
so a registry here, or any global object it names, would be a copy) so that the ingress can list
the replicas.

Only Serve's public request-router API is used (`ray.serve.request_router`, Ray >= 2.50 tested on
2.60). The router relies on one behaviour of it: without FIFOMixin, a replica chosen for a request
goes to that very request (Serve matches by request id), not to the oldest pending one; otherwise
concurrent conversations would be sent where another one's prefix is. tests/test_serve_ray.py
checks it under concurrency, tests/test_router_policy.py that FIFOMixin is not mixed in.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from iterserve.routing import ReplicaLoad, RouterConfig, RoutingPolicy
from iterserve.serve_ray.registry import register_router

# A request counted on a replica when first ranked but never routed (its caller went away while it
# waited for a replica) is forgotten, and uncounted, this long after it was ranked: no request
# waits that long for a replica without having been routed.
TENTATIVE_TTL_S = 120.0


class IterserveRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """Serve passes request_router_kwargs here: `deployment` (the name the ingress looks this
        router up by) and RouterConfig's fields."""
        register_router(kwargs.pop("deployment"), self)
        self.policy = RoutingPolicy(RouterConfig(**kwargs))
        # request id -> (replica it was counted on when first ranked, its prompt's block hashes,
        # when), oldest first
        self._tentative: OrderedDict[str, tuple[str, list | None, float]] = OrderedDict()

    def reports(self) -> dict[str, dict]:
        """Each current replica's latest routing stats (EngineReplica.record_routing_stats)."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.update_replicas([r.replica_id.unique_id for r in replicas])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for rid, r in by_id.items():
            stats = r.routing_stats or {}
            self.policy.report(rid, ReplicaLoad(**{k: stats[k] for k in ReplicaLoad.__dataclass_fields__
                                                   if k in stats}))
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return [[by_id[rid] for rid in rank] for rank in self.policy.rank(list(by_id), None)]
        self._forget_stale_tentative(time.monotonic())
        key = pending_request.metadata.request_id
        counted = self._tentative.get(key)
        hashes = counted[1] if counted else self.policy.block_hashes(self._token_ids(pending_request))
        ranks = self.policy.rank(list(by_id), hashes)
        if counted is None and ranks[0]:
            # counted now, not once sent: requests routed at the same moment must see each other
            self._tentative[key] = (ranks[0][0], hashes, time.monotonic())
            self.policy.routed(ranks[0][0], hashes)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        counted = self._tentative.pop(pending_request.metadata.request_id, None)
        if counted is not None and counted[0] != replica_id.unique_id:  # Serve took another rank
            self.policy.unrouted(counted[0])
            self.policy.routed(replica_id.unique_id, counted[1])

    def _forget_stale_tentative(self, now: float) -> None:
        """Uncounts requests ranked long ago and never routed (cancelled while pending), so that
        neither this map nor a replica's in-transit count grows with them."""
        while self._tentative:
            key, (replica, _, since) = next(iter(self._tentative.items()))
            if now - since < TENTATIVE_TTL_S:
                return
            del self._tentative[key]
            self.policy.unrouted(replica)

    @staticmethod
    def _token_ids(pending_request: PendingRequest) -> list[int] | None:
        ids = pending_request.kwargs.get("prompt_token_ids")
        if ids is None and len(pending_request.args) > 1:
            ids = pending_request.args[1]
        return ids
