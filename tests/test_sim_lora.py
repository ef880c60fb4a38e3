"""LoRA adapters in the simulator (sim/lora.py): adapter rows are priced per token and per adapter
in a step, residency in --max-loras slots follows the engine's own rule through the real scheduler,
and the same prompt under two adapters shares no KV blocks."""
from __future__ import annotations

import pytest
from test_sim import linear_profile, workload

from iterserve.bench.workload import RequestSpec
from iterserve.config import EngineConfig
from iterserve.core.scheduler import Scheduler
from iterserve.sampling import SamplingParams
from iterserve.sim.lora import LoRAPolicy
from iterserve.sim.simulator import SimEngine, simulate
from iterserve.sim.step_model import step_features


def test_adapter_rows_are_priced_per_token_and_per_adapter():
    specs, prof = workload(n=120), linear_profile()
    cfg = EngineConfig(max_num_seqs=8, max_loras=4)
    base = simulate(specs, cfg, prof)
    free = simulate(specs, cfg, prof, lora=LoRAPolicy(4))  # adapters that cost nothing change nothing
    assert free.result.summary() == base.result.summary()
    assert free.stats["lora_loads"] == 4
    priced = simulate(specs, cfg, prof, lora=LoRAPolicy(4, token_s=1e-3, adapter_s=2e-3))
    assert priced.result.summary()["e2e_ms"]["mean"] > base.result.summary()["e2e_ms"]["mean"]
    # one step, exactly: the base model's time plus 1 ms per adapter token plus 2 ms per adapter
    policy = LoRAPolicy(2, fraction=1.0, token_s=1e-3, adapter_s=2e-3)
    e = SimEngine(cfg, prof, lora=policy)
    for i in range(3):
        e.add(RequestSpec(i, 0.0, 40 + i, 8), SamplingParams(max_tokens=8))
    e.start_step(0.0)
    sched = e.in_flight
    tokens = sum(s.num_tokens for s in sched.scheduled)
    assert {s.request.lora_name for s in sched.scheduled} == {"lora0", "lora1"}
    want = prof.step_model.predict(step_features(sched, cfg.block_size)) + 1e-3 * tokens + 2 * 2e-3
    assert e.run_end - e.step_start == pytest.approx(want)
    with pytest.raises(ValueError):
        LoRAPolicy(0)
    assert {LoRAPolicy(4).adapter_of(i) for i in range(100)} == {f"lora{j}" for j in range(4)}
    assert {LoRAPolicy(4, fraction=0.0).adapter_of(i) for i in range(100)} == {None}


def test_residency_limits_adapters_per_step(monkeypatch):
    """4 adapters in 2 slots: no step ever runs more than 2 adapters, everything completes, and each
    adapter that had to come back counts as a load."""
    seen: list[set] = []
    original = Scheduler.schedule

    def schedule(self, now):
        out = original(self, now)
        seen.append({r.lora_name for r in self.running if r.lora_name})
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    specs, prof = workload(n=150, rate=50.0), linear_profile()
    run = simulate(specs, EngineConfig(max_num_seqs=8, max_loras=2), prof, lora=LoRAPolicy(4))
    assert run.result.summary()["completed"] == len(specs)
    assert max(len(s) for s in seen) == 2
    assert run.stats["lora_loads"] > 4


def test_same_prompt_under_two_adapters_shares_no_blocks():
    prof = linear_profile()
    # a 200-token system prompt in common, then each its own
    specs = [RequestSpec(0, 0.0, 256, 8, system_prompt_len=200), RequestSpec(1, 1.0, 256, 8, system_prompt_len=200)]
    cfg = EngineConfig(max_num_seqs=8, max_loras=2)
    shared = simulate(specs, cfg, prof)
    assert shared.stats["prefix_cache_hits"] > 0
    apart = simulate(specs, cfg, prof, lora=LoRAPolicy(2))  # request 0 under lora0, request 1 under lora1
    assert apart.stats["prefix_cache_hits"] == 0
