"""Prometheus series of the LoRA adapters (--enable-lora), read from the engine's LoRAManager at
each scrape: per adapter requests and tokens, resident adapters, slot loads, and vLLM's
`vllm:lora_requests_info` (a gauge whose labels name the running and waiting requests' adapters).

A collector of its own rather than entries in metrics.py's list: the per-adapter label sets come
and go with /v1/load_lora_adapter, and every value is already counted by the manager.
"""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class LoRACollector(Collector):
    def __init__(self, llm, model_name: str, vllm_names: bool = True) -> None:
        self.llm, self.model_name, self.vllm_names = llm, model_name, vllm_names

    def _adapters_of(self, requests) -> str:
        return ",".join(sorted({r.lora_name for r in requests if r.lora_name}))

    def collect(self):
        lora = self.llm.lora
        m = self.model_name
        # list() copies are atomic under the GIL: the engine thread may change the queues meanwhile
        running = self._adapters_of(list(self.llm.scheduler.running))
        waiting = self._adapters_of(list(self.llm.scheduler.waiting))
        for prefix in ("iterserve", "vllm") if self.vllm_names else ("iterserve",):
            info = GaugeMetricFamily(f"{prefix}:lora_requests_info", "Running and waiting requests' LoRA adapters "
                                     "(labels); the value is the time of the reading.",
                                     labels=["model_name", "max_lora", "running_lora_adapters",
                                             "waiting_lora_adapters"])
            info.add_metric([m, str(lora.max_loras), running, waiting], time.time())
            yield info
        resident = GaugeMetricFamily("iterserve:lora_resident_adapters", "LoRA adapters resident in slots now.",
                                     labels=["model_name"])
        resident.add_metric([m], len(lora.resident))
        yield resident
        loads = CounterMetricFamily("iterserve:lora_loads", "LoRA adapters copied into a resident slot since start.",
                                    labels=["model_name"])
        loads.add_metric([m], lora.stats.loads)
        yield loads
        s = lora.stats
        for name, doc, counts in (("lora_requests", "Requests per LoRA adapter since start.", s.requests),
                                  ("lora_prompt_tokens", "Prompt tokens per LoRA adapter since start.",
                                   s.prompt_tokens),
                                  ("lora_generation_tokens", "Generated tokens per LoRA adapter since start.",
                                   s.generation_tokens)):
            fam = CounterMetricFamily(f"iterserve:{name}", doc, labels=["model_name", "lora_name"])
            for adapter, value in dict(counts).items():
                fam.add_metric([m, adapter], value)
            yield fam
