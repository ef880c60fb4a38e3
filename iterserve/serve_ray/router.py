"""IterserveRequestRouter: Ray Serve's RequestRouter running policy.RoutingPolicy in the ingress.

Serve instantiates the router inside each handle's process (the ingress) and asks it to rank the
candidate replicas for every call. A `generate` call is ranked by the policy from its token ids. Replicas' load, and the state the
ingress shows per replica, arrive through Serve's routing stats (EngineReplica.record_routing_stats).
Each router registers itself with policy.register_router (a function of another module: Serve
ships this module by value, so a registry here, or any global object it names, would be a copy) so that the ingress can list the replicas.
"""
from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from iterserve.serve_ray.policy import ReplicaLoad, RouterConfig, RoutingPolicy, register_router


class IterserveRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """Serve passes request_router_kwargs here: RouterConfig's fields."""
        self.policy = RoutingPolicy(RouterConfig(**kwargs))
        self._tentative: dict[str, str] = {}  # request id -> replica it was counted on when ranked
        register_router(self._deployment_id.name, self)

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
        ids = self._token_ids(pending_request)
        ranks = self.policy.rank(list(by_id), ids)
        if pending_request is not None and pending_request.metadata.call_method == "generate" and ranks[0]:
            # counted now, not once sent: requests routed at the same moment must see each other
            key = pending_request.metadata.request_id
            if key not in self._tentative:
                self._tentative[key] = ranks[0][0]
                self.policy.routed(ranks[0][0], ids)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        guess = self._tentative.pop(pending_request.metadata.request_id, None)
        if guess is not None and guess != replica_id.unique_id:  # Serve took another rank
            self.policy.unrouted(guess)
            self.policy.routed(replica_id.unique_id, self._token_ids(pending_request))

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        """The replica was ranked for this very request: it gets it. Serve's default hands a chosen
        replica to the oldest pending request instead (FIFO), which under concurrency would send a
        request where another one's prefix is. The
        override is of the hook Serve's multiplexing mixin uses (a private name, checked by the
        tests against the Ray version installed)."""
        if request_metadata is None:
            return None
        for pr in self._pending_requests_to_fulfill:
            if pr.metadata is request_metadata and not pr.future.done():
                return pr
        return None

    @staticmethod
    def _token_ids(pending_request: PendingRequest | None) -> list[int] | None:
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return None
        ids = pending_request.kwargs.get("prompt_token_ids")
        if ids is None and len(pending_request.args) > 1:
            ids = pending_request.args[1]
        return ids
