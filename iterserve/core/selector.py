"""The scheduler that EngineConfig.batching names: the only place that maps the setting to a class."""
from __future__ import annotations

from iterserve.config import EngineConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import Scheduler, SchedulerBase
from iterserve.core.static import StaticScheduler

SCHEDULERS: dict[str, type[SchedulerBase]] = {"continuous": Scheduler, "static": StaticScheduler}


def build_scheduler(config: EngineConfig, pool: BlockPool, max_model_len: int) -> SchedulerBase:
    return SCHEDULERS[config.batching](config, pool, max_model_len)
