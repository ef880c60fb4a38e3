"""The scale-out router's policy on its own (no Ray): what each --router choice ranks first."""
from __future__ import annotations

import pytest

from iterserve.core.block_hash import hash_block_chain
from iterserve.serve_ray.policy import ReplicaLoad, RouterConfig, RoutingPolicy


def policy(name: str, **kw) -> RoutingPolicy:
    p = RoutingPolicy(RouterConfig(policy=name, block_size=4, **kw))
    p.update_replicas(["a", "b"])
    return p


def first(p: RoutingPolicy, ids) -> str:
    return p.rank(["a", "b"], ids)[0][0]


def test_prefix_follows_the_replica_that_holds_the_prompt():
    p = policy("prefix")
    conv = list(range(100, 112))
    p.routed("b", conv)
    assert first(p, conv + [7, 8, 9, 10]) == "b"  # the next turn extends the prompt b computed
    assert first(p, [1, 2, 3, 4, 5]) == "a"  # no match: the replica holding less (ties on load)


def test_prefix_gives_way_to_load_beyond_the_threshold():
    p = policy("prefix", imbalance_threshold=2)
    conv = list(range(12))
    p.routed("b", conv)
    p.report("b", ReplicaLoad(running=5, received_total=1))
    assert first(p, conv) == "a"


def test_short_match_routes_by_load():
    p = policy("prefix", min_match_blocks=3)
    p.routed("b", list(range(8)))  # two blocks held
    p.report("a", ReplicaLoad(received_total=0))
    p.report("b", ReplicaLoad(running=1, received_total=1))
    assert first(p, list(range(8)) + [50, 51, 52, 53]) == "a"


def test_requests_in_transit_count_as_load():
    p = policy("least-loaded")
    p.routed("a", None)
    p.routed("a", None)  # sent, not yet reported by a
    assert first(p, None) == "b"


def test_round_robin_alternates():
    p = policy("round-robin")
    assert [first(p, None) for _ in range(4)] == ["a", "b", "a", "b"]


def test_hashes_are_the_prefix_caches():
    p = policy("prefix")
    ids = list(range(9))
    p.routed("a", ids)
    assert set(p.replicas["a"].hashes) == set(hash_block_chain(ids, 4))


def test_bad_router_name_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        RouterConfig(policy="random")


def test_replicas_without_ray_says_how_to_install(monkeypatch):
    import sys

    from iterserve.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as if it were not installed
    for name in [m for m in sys.modules if m.startswith("iterserve.serve_ray.") and m != "iterserve.serve_ray.policy"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit, match=r"pip install 'iterserve\[ray\]'"):
        main(["serve", "--replicas", "2", "--port", "0"])
