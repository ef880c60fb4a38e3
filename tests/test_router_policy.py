"""The scale-out router's policy on its own (no Ray): what each --router choice ranks first."""
from __future__ import annotations

import pytest

from iterserve.core.block_hash import hash_block_chain
from iterserve.routing import ReplicaLoad, RouterConfig, RoutingPolicy


def policy(name: str, **kw) -> RoutingPolicy:
    p = RoutingPolicy(RouterConfig(policy=name, block_size=4, **kw))
    p.update_replicas(["a", "b"])
    return p


def first(p: RoutingPolicy, ids) -> str:
    return p.rank(["a", "b"], p.block_hashes(ids))[0][0]


def routed(p: RoutingPolicy, replica: str, ids) -> None:
    p.routed(replica, p.block_hashes(ids))


def test_prefix_follows_the_replica_that_holds_the_prompt():
    p = policy("prefix")
    conv = list(range(100, 112))
    routed(p, "b", conv)
    assert first(p, conv + [7, 8, 9, 10]) == "b"  # the next turn extends the prompt b computed
    assert first(p, [1, 2, 3, 4, 5]) == "a"  # no match: the replica sent nothing lately (ties on load)


def test_new_conversations_alternate_when_none_overlaps():
    """Each conversation's first turn finishes before the next one arrives, so both replicas report
    idle every time; b holds many remembered blocks from earlier traffic. New conversations still
    alternate (a tie-break on remembered blocks sent every one of them to a)."""
    p = policy("prefix")
    for i in range(5):
        routed(p, "b", list(range(1000 * i, 1000 * i + 40)))  # ten blocks each
    received = {"a": 0, "b": 5}
    p.report("b", ReplicaLoad(received_total=5))
    homes = []
    for conv in range(4):
        prompt = [conv + 1] * 12
        home = first(p, prompt)
        routed(p, home, prompt)
        received[home] += 1
        p.report(home, ReplicaLoad(received_total=received[home]))  # done: idle again
        homes.append(home)
        assert first(p, prompt + [7, 7, 7, 7]) == home  # its next turn follows it
    assert homes == ["a", "b", "a", "b"]


def test_prefix_gives_way_to_load_beyond_the_threshold():
    p = policy("prefix", imbalance_threshold=2)
    conv = list(range(12))
    routed(p, "b", conv)
    p.report("b", ReplicaLoad(running=5, received_total=1))
    assert first(p, conv) == "a"


def test_short_match_routes_by_load():
    p = policy("prefix", min_match_blocks=3)
    routed(p, "b", list(range(8)))  # two blocks held
    p.report("a", ReplicaLoad(received_total=0))
    p.report("b", ReplicaLoad(running=1, received_total=1))
    assert first(p, list(range(8)) + [50, 51, 52, 53]) == "a"


def test_requests_in_transit_count_as_load():
    p = policy("least-loaded")
    routed(p, "a", None)
    routed(p, "a", None)  # sent, not yet reported by a
    assert first(p, None) == "b"


def test_round_robin_alternates():
    p = policy("round-robin")
    assert [first(p, None) for _ in range(4)] == ["a", "b", "a", "b"]


def test_hashes_are_the_prefix_caches():
    p = policy("prefix")
    ids = list(range(9))
    routed(p, "a", ids)
    assert set(p.replicas["a"].hashes) == set(hash_block_chain(ids, 4))


def test_bad_router_name_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        RouterConfig(policy="random")


def test_replicas_without_ray_says_how_to_install(monkeypatch):
    import sys

    from iterserve.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as if it were not installed
    for name in [m for m in sys.modules if m.startswith("iterserve.serve_ray.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit, match=r"pip install 'iterserve\[ray\]'"):
        main(["serve", "--replicas", "2", "--port", "0"])


def test_router_uses_only_serves_public_router_api():
    """Serve's public request-router surface is all the router needs; if a Ray release moves it, or
    the router picks up FIFOMixin (a chosen replica would go to the oldest pending request, not the
    one it was ranked for), this fails here rather than as misrouted conversations."""
    request_router = pytest.importorskip("ray.serve.request_router")
    from iterserve.serve_ray.router import IterserveRequestRouter

    assert {"RequestRouter", "PendingRequest", "RunningReplica", "ReplicaID", "FIFOMixin"} <= set(request_router.__all__)
    assert request_router.FIFOMixin not in IterserveRequestRouter.__mro__
    for hook in ("initialize_state", "choose_replicas", "on_request_routed", "update_replicas", "curr_replicas"):
        assert hasattr(request_router.RequestRouter, hook), hook
    assert isinstance(request_router.RunningReplica.routing_stats, property)


def test_router_forgets_a_request_cancelled_before_it_was_routed(monkeypatch):
    """A request ranked (and counted on a replica) whose caller went away before Serve routed it
    never reaches on_request_routed: after TENTATIVE_TTL_S it is uncounted, so the replica's load
    and the router's memory do not grow with such requests."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray.serve.request_router")
    from iterserve.serve_ray import router as router_mod

    r = object.__new__(router_mod.IterserveRequestRouter)  # Serve's own __init__ needs a cluster
    r.initialize_state(deployment="test-tentative", policy="least-loaded")
    r.policy.update_replicas(["a", "b"])
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={}) for rid in "ab"]

    def pending(rid: str):
        return SimpleNamespace(metadata=SimpleNamespace(call_method="generate", request_id=rid),
                               kwargs={"prompt_token_ids": [1, 2, 3]}, args=())

    now = [1000.0]
    monkeypatch.setattr(router_mod.time, "monotonic", lambda: now[0])
    first = asyncio.run(r.choose_replicas(replicas, pending("gone")))[0][0].replica_id.unique_id
    assert r.policy.load(first) == 1 and len(r._tentative) == 1  # counted when ranked
    now[0] += router_mod.TENTATIVE_TTL_S - 1
    asyncio.run(r.choose_replicas(replicas, pending("second")))
    assert "gone" in r._tentative  # not yet stale
    now[0] += 2
    asyncio.run(r.choose_replicas(replicas, pending("third")))
    assert "gone" not in r._tentative and set(r._tentative) == {"second", "third"}
    assert r.policy.load("a") + r.policy.load("b") == 2  # only the two still pending count
