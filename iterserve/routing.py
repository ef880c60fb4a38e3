"""Which replica should get a request: round-robin, least loaded, or the one expected to hold its prefix.

One policy for every place that routes: the Ray Serve deployment (serve_ray/router.py adapts it to
Serve's RequestRouter) and the capacity simulator (sim/router.py adapts it to simulated replicas), so
that `simulate`/`plan` predict the router the deployment runs, `prefix` (its default) included. Pure
Python and Ray-free: tested on its own, imported by the simulator without Ray, and by
`serve`'s flags without importing serve_ray.

The prefix policy (after SGLang's cache-aware router and Ray's PrefixCacheAffinityRouter): the router
remembers, per replica, the block hashes of the prompts it sent there, computed exactly as the
engines' prefix cache computes them (core/block_hash.py, same block size), so the match it finds is
the number of the request's leading full blocks the replica has computed -- unless the replica has
since evicted them, which the router cannot see (it forgets the oldest hashes beyond
`max_blocks_per_replica`). It then picks the replica with the longest match, unless
- the match is shorter than `min_match_blocks` (nothing worth keeping: balance load instead), or
- load is imbalanced: the busiest replica has more than `imbalance_threshold` requests above the
  idlest, in which case the least loaded wins whatever it holds (a hot prefix must not pile every
  conversation on one replica).
Only the prompt's blocks are remembered, not the generated answer's, so the next turn of a
conversation matches through the previous turn's prompt (the answer's blocks are one turn behind).

Load = running + waiting as the replica last reported them (routing stats) + requests this router
sent it that the replica had not yet received at that report (so a burst between two reports is
spread, not sent to one replica that looked idle).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from iterserve.core.block_hash import BlockHash, hash_block_chain

POLICIES = ("round-robin", "least-loaded", "prefix")


@dataclass
class RouterConfig:
    """Every switch of the router (`iterserve serve --router ...`)."""

    policy: str = "prefix"
    block_size: int = 16  # must be the engines' block size: hashes are per full block
    min_match_blocks: int = 1  # a shorter best match routes by load
    imbalance_threshold: int = 8  # max - min load (requests) beyond which load wins over prefix
    max_blocks_per_replica: int = 1 << 16  # remembered hashes per replica (oldest forgotten first)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.min_match_blocks < 0 or self.imbalance_threshold < 0 or self.max_blocks_per_replica < 1:
            raise ValueError("router thresholds must be >= 0 (max_blocks_per_replica >= 1)")


@dataclass
class ReplicaLoad:
    """What a replica reports through Serve's routing stats (replica.py record_routing_stats)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    received_total: int = 0  # requests the replica has received since it started


@dataclass
class _Replica:
    hashes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    routed_total: int = 0  # requests this router sent it
    last_routed: int = -1  # sequence number of the latest request sent it (-1: none yet)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)


class RoutingPolicy:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas: dict[str, _Replica] = {}
        self._rr = itertools.count()
        self._sent = itertools.count()  # numbers routed requests, for last_routed

    # ---- state ----------------------------------------------------------------------------------
    def update_replicas(self, replica_ids: list[str]) -> None:
        """Keeps what is known about replicas still there; a new (or restarted) one starts empty."""
        self.replicas = {rid: self.replicas.get(rid) or _Replica() for rid in replica_ids}

    def report(self, replica_id: str, load: ReplicaLoad) -> None:
        rep = self.replicas.get(replica_id)
        if rep is not None:
            if load.received_total < rep.load.received_total:  # restarted under the same id
                rep.routed_total = load.received_total
            rep.load = load

    def block_hashes(self, token_ids: list[int] | None) -> list[BlockHash] | None:
        """A prompt's block hashes, which rank() and routed() take: computed once per request (a
        request can be ranked several times), and only by the prefix policy (None otherwise)."""
        if not token_ids or self.config.policy != "prefix":
            return None
        return hash_block_chain(token_ids, self.config.block_size)

    def routed(self, replica_id: str, hashes: list[BlockHash] | None) -> None:
        """Records a request sent to replica_id: its prompt's blocks are (about to be) cached there."""
        rep = self.replicas.get(replica_id)
        if rep is None:
            return
        rep.routed_total += 1
        rep.last_routed = next(self._sent)
        if hashes:
            for h in hashes:
                rep.hashes[h] = None
                rep.hashes.move_to_end(h)
            while len(rep.hashes) > self.config.max_blocks_per_replica:
                rep.hashes.popitem(last=False)

    def unrouted(self, replica_id: str) -> None:
        """A request counted on replica_id went elsewhere (its remembered blocks stay: a harmless guess)."""
        rep = self.replicas.get(replica_id)
        if rep is not None:
            rep.routed_total = max(0, rep.routed_total - 1)

    # ---- choice ---------------------------------------------------------------------------------
    def load(self, replica_id: str) -> int:
        rep = self.replicas[replica_id]
        in_transit = max(0, rep.routed_total - rep.load.received_total)
        return rep.load.running + rep.load.waiting + in_transit

    def match_blocks(self, replica_id: str, hashes: list[BlockHash]) -> int:
        held = self.replicas[replica_id].hashes
        n = 0
        for h in hashes:  # chained hashes: the first miss ends the shared prefix
            if h not in held:
                break
            n += 1
        return n

    def rank(self, candidates: list[str], hashes: list[BlockHash] | None) -> list[list[str]]:
        """Candidates in order of preference, one per rank (Serve tries the first rank first);
        hashes: block_hashes() of the prompt."""
        candidates = [c for c in candidates if c in self.replicas] or list(candidates)
        for c in candidates:
            self.replicas.setdefault(c, _Replica())
        if len(candidates) <= 1:
            return [candidates]
        policy = self.config.policy
        if policy == "round-robin":
            start = next(self._rr) % len(candidates)
            order = candidates[start:] + candidates[:start]
            return [[c] for c in order]
        # ties (e.g. all idle) go to the replica sent a request least recently, so that new
        # conversations alternate even when each finishes before the next arrives (then no load
        # tells them apart). Not to the one holding the fewest remembered blocks: a replica that
        # earlier traffic left holding many would see every new conversation go elsewhere.
        by_load = sorted(candidates, key=lambda c: (self.load(c), self.replicas[c].load.kv_usage,
                                                    self.replicas[c].last_routed))
        if policy == "least-loaded" or not hashes:
            return [[c] for c in by_load]
        loads = [self.load(c) for c in candidates]
        if max(loads) - min(loads) > self.config.imbalance_threshold:
            return [[c] for c in by_load]
        matches = {c: self.match_blocks(c, hashes) for c in candidates}
        best = max(matches.values())
        if best < max(1, self.config.min_match_blocks):
            return [[c] for c in by_load]
        # longest match first; among equal matches the less loaded
        order = sorted(candidates, key=lambda c: (-matches[c], by_load.index(c)))
        return [[c] for c in order]
