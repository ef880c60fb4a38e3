"""LoRA adapters in the simulator: which requests carry one, what their rows cost, and residency.

What an adapter row costs does not depend on the text, only on the step: each projection adds a
rank-R product for the rows of each adapter (lora/layers.py), so a step pays `token_s` per token of
an adapter row and `adapter_s` per distinct adapter in it. Both are measured, not modelled from
FLOPs (benchmarks/lora_throughput.py prints them for a host; docs/server.md has this host's).
Residency is the engine's own: the real scheduler asks `ensure_resident` of a slot table with the
engine's LRU (lora/slots.py), so a request whose adapter is not resident waits for a slot here as it
does there, and the loads are counted. The adapters' identity also goes into the requests' block
hashes, as in the engine, so the same prompt under two adapters shares no KV.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.core.scheduler import SchedulerOutput
from iterserve.lora.slots import SlotTable


@dataclass
class LoRAPolicy:
    num_adapters: int  # adapters the traffic spreads over (names lora0, lora1, ...)
    fraction: float = 1.0  # share of requests that carry an adapter (the rest: the base model)
    token_s: float = 0.0  # seconds per token of an adapter row in a step
    adapter_s: float = 0.0  # seconds per distinct adapter in a step

    def __post_init__(self) -> None:
        if self.num_adapters < 1 or not 0.0 <= self.fraction <= 1.0:
            raise ValueError("LoRA simulation needs num_adapters >= 1 and fraction in [0, 1]")
        if self.token_s < 0 or self.adapter_s < 0:
            raise ValueError("LoRA costs must be >= 0")

    def adapter_of(self, index: int) -> str | None:
        """The adapter of request `index`: a fixed spread (the same run gives the same answer), the
        adapters taking turns among the requests that carry one."""
        if (index * 2654435761 % 2**32) / 2**32 >= self.fraction:
            return None
        return f"lora{index % self.num_adapters}"

    def price(self, sched: SchedulerOutput) -> float:
        rows = [s for s in sched.scheduled if s.request.lora_name is not None]
        return self.token_s * sum(s.num_tokens for s in rows) + self.adapter_s * len({s.request.lora_name for s in rows})


@dataclass
class SimResidency:
    """What the scheduler asks of LoRAManager, without weights: the engine's slot table."""
    slots: SlotTable
    loads: int = 0
    loaded_names: list[str] = field(default_factory=list)

    def ensure_resident(self, name: str, busy: set[str]) -> bool:
        got = self.slots.acquire(name, busy)
        if got is None:
            return False
        if got.loaded:
            self.loads += 1
        return True
