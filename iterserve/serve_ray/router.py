"""IterserveRequestRouter: Ray Serve's RequestRouter running policy.RoutingPolicy in the ingress.

Serve instantiates the router inside each handle's process (the ingress) and asks it to rank the
candidate replicas for every call. A `generate` call is ranked by the policy from its token ids; a
call that names `target_replica` (the ingress's per-replica /metrics and /v1/scheduler) goes to that
replica only. Replicas' load arrives through Serve's routing stats (EngineReplica.record_routing_stats).
Each router registers its policy with policy.register_policy (a function of another module: Serve
ships this module by value, so a registry here, or any global object it names, would be a copy) so that the ingress can list the replicas.
"""
from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from iterserve.serve_ray.policy import ReplicaLoad, RouterConfig, RoutingPolicy, register_policy


class IterserveRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """Serve passes request_router_kwargs here: RouterConfig's fields."""
        self.policy = RoutingPolicy(RouterConfig(**kwargs))
        register_policy(self._deployment_id.name, self.policy)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.update_replicas([r.replica_id.unique_id for r in replicas])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        for rid, r in by_id.items():
            stats = r.routing_stats or {}
            self.policy.report(rid, ReplicaLoad(**{k: stats[k] for k in ReplicaLoad.__dataclass_fields__
                                                   if k in stats}))
        ranks = self.policy.rank(list(by_id), self._token_ids(pending_request))
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if pending_request.kwargs.get("target_replica") is None and pending_request.metadata.call_method == "generate":
            self.policy.routed(replica_id.unique_id, self._token_ids(pending_request))

    @staticmethod
    def _token_ids(pending_request: PendingRequest | None) -> list[int] | None:
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return None
        ids = pending_request.kwargs.get("prompt_token_ids")
        if ids is None and len(pending_request.args) > 1:
            ids = pending_request.args[1]
        return ids
