"""The simulator routes with the deployment's routing policy (iterserve/routing.py): `simulate
--router prefix` makes the choices the Ray ingress's router would make, fed the same prompts and the
same replica loads."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from iterserve.bench.conversation import ConversationOptions
from iterserve.cli import build_parser
from iterserve.config import EngineConfig
from iterserve.routing import RoutingPolicy
from iterserve.sim.profile import Profile
from iterserve.sim.router import Router, make_router
from iterserve.sim.simulator import DISTINCT_SYSTEM_PROMPT_IDS, conversation_plans, simulate
from iterserve.sim.step_model import LinearStepModel

REPLICAS = 3


def linear_profile() -> Profile:
    return Profile(kind="measured", model="test", dtype="float32",
                   step_model=LinearStepModel([0.004, 0.0002, 0.00002, 0.0, 1e-7, 0.0]),
                   kv_bytes_per_token=1024, max_model_len=2048)


def simulated_choices(monkeypatch, system_prompts: str) -> list[tuple[list[int], list[int], int]]:
    """(prompt ids, each replica's load, replica chosen) for every request of a multi-turn run under
    --router prefix, in routing order."""
    calls: list[tuple[list[int], list[int], int]] = []
    route = Router.route

    def spy(self: Router, ids: list[int], replicas) -> int:
        loads = [r.load for r in replicas]
        chosen = route(self, ids, replicas)
        calls.append((list(ids), loads, chosen))
        return chosen

    monkeypatch.setattr(Router, "route", spy)
    opts = ConversationOptions(num_conversations=6, turns=4, system_prompt_len=64, system_prompts=system_prompts,
                               user_len=(16, 48), output_len=(8, 32), think_time_s=0.5, stagger_s=1.0, seed=3)
    run = simulate([], EngineConfig(max_num_seqs=4, block_size=16), linear_profile(), replicas=REPLICAS,
                   router="prefix", conversations=conversation_plans(opts))
    assert run.stats["router"] == "prefix" and run.result.summary()["completed"] == len(calls) == 24
    return calls


def deployment_choices(calls: list[tuple[list[int], list[int], int]]) -> list[int]:
    """The Ray ingress's router (serve_ray/router.py, Serve's own constructor bypassed: it needs a
    cluster) ranking the same prompts with the replicas reporting the same loads; each request is
    received by its replica at once, as in the simulator."""
    from iterserve.serve_ray.router import IterserveRequestRouter

    r = object.__new__(IterserveRequestRouter)
    r.initialize_state(deployment="test-sim-router", policy="prefix", block_size=16)
    ids_ = [str(i) for i in range(REPLICAS)]
    r.policy.update_replicas(ids_)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={}) for rid in ids_]
    received = [0] * REPLICAS
    choices = []
    for n, (ids, loads, _) in enumerate(calls):
        for i, rep in enumerate(replicas):
            rep.routing_stats = {"running": loads[i], "waiting": 0, "received_total": received[i]}
        pending = SimpleNamespace(metadata=SimpleNamespace(call_method="generate", request_id=f"r{n}"),
                                  kwargs={"prompt_token_ids": ids}, args=())
        first = asyncio.run(r.choose_replicas(replicas, pending))[0][0]
        r.on_request_routed(pending, first.replica_id, None)
        chosen = int(first.replica_id.unique_id)
        received[chosen] += 1
        choices.append(chosen)
    return choices


@pytest.mark.parametrize("system_prompts", ["shared", "distinct"])
def test_simulated_prefix_routing_is_the_deployments(monkeypatch, system_prompts):
    pytest.importorskip("ray.serve.request_router")
    calls = simulated_choices(monkeypatch, system_prompts)
    assert deployment_choices(calls) == [chosen for *_, chosen in calls]


def test_prefix_keeps_each_conversation_on_one_replica(monkeypatch):
    """Distinct system prompts: a first turn matches nowhere (goes by load), every later turn extends
    a prompt its replica computed; loads stay under the imbalance threshold, so prefix decides."""
    calls = simulated_choices(monkeypatch, "distinct")
    replica_of: dict[int, set[int]] = {}
    for ids, _, chosen in calls:
        replica_of.setdefault(ids[0] - DISTINCT_SYSTEM_PROMPT_IDS, set()).add(chosen)
    assert len(replica_of) == 6 and all(len(r) == 1 for r in replica_of.values())
    assert {c for *_, c in calls} == set(range(REPLICAS))  # conversations spread over the replicas


def test_simulator_routes_with_the_shared_policy():
    router = make_router("prefix", block_size=16)
    assert isinstance(router.policy, RoutingPolicy) and router.policy.config.block_size == 16


def test_simulate_and_plan_offer_the_deployments_policies(capsys):
    parser = build_parser()
    for command in ("simulate", "plan"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "prefix" in capsys.readouterr().out
    assert parser.parse_args(["simulate", "--profile", "p.json", "--router", "prefix"]).router == "prefix"
