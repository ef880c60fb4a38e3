"""Static (request-level) batching, kept faithful so that it can be compared on equal terms.

How static batchers such as a `transformers.generate` loop behind a queue behave:
- a batch starts when `max_batch_size` requests wait, or when the oldest has waited `batch_timeout_ms`;
- nobody joins a running batch;
- KV is reserved up front, contiguously, for the batch's longest possible sequence
  (longest prompt + largest max_tokens), not paged on demand;
- the batch runs until its slowest member finishes: finished members keep their slot and are still
  computed every step (padding work) and are released, with their blocks, only when all are done.

Only the scheduling and the KV reservation differ from continuous batching; the model, runner and
sampler are the same.
"""
from __future__ import annotations

from iterserve.core.scheduler import ScheduledRequest, SchedulerBase, SchedulerOutput
from iterserve.request import Request, RequestStatus


class StaticScheduler(SchedulerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.done: set[str] = set()  # members of the running batch that have finished

    def _start_batch(self, now: float) -> None:
        cfg = self.config
        if not self.waiting:
            return
        oldest_wait_ms = (now - min(r.times.arrival for r in self.waiting)) * 1000.0
        if len(self.waiting) < cfg.max_batch_size and oldest_wait_ms < cfg.batch_timeout_ms:
            return
        batch: list[Request] = []
        for req in self.waiting:
            if len(batch) == cfg.max_batch_size:
                break
            batch.append(req)
        # shrink the batch until every member's contiguous reservation fits the pool
        while batch:
            reserve = min(self.max_model_len, max(r.num_prompt_tokens for r in batch)
                          + max(r.params.max_tokens for r in batch))
            if self.pool.blocks_for(reserve) * self.pool.num_groups * len(batch) <= self.pool.num_free:
                break
            batch.pop()
        for req in batch:
            if not self.pool.allocate_contiguous(req.request_id, reserve):
                raise RuntimeError("contiguous KV reservation failed in an empty pool")
            self.waiting.remove(req.request_id)
            req.status = RequestStatus.RUNNING
            req.times.first_scheduled = now
            self.running.append(req)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            self._start_batch(now)
        for req in self.running:
            if req.request_id in self.done:
                out.scheduled.append(self._padding(req))
            else:
                n = req.num_tokens - req.num_computed_tokens
                self.pool.note_tokens(req.request_id, req.num_computed_tokens + n)  # KV usage figures
                out.scheduled.append(self._scheduled(req, n))
        return out

    def _padding(self, req: Request) -> ScheduledRequest:
        """A finished member keeps being computed, as a static batcher would: its last token again,
        at its next position (kept inside its reservation), sampled and dropped."""
        tables = self.pool.group_tables[req.request_id]
        start = min(req.num_computed_tokens, len(tables[0]) * self.pool.block_size - 1)
        return ScheduledRequest(req, 1, start, tables[0], [req.token_at(req.num_tokens - 1)], sample=True,
                                padding=True, block_tables=tables if len(tables) > 1 else [])

    def finish(self, req: Request) -> list[tuple[Request, int]]:
        if req not in self.running:
            return [(req, 0)]
        self.done.add(req.request_id)
        if len(self.done) < len(self.running):
            return []
        released = [(r, self.pool.free(r.request_id)) for r in self.running]
        self.running.clear()
        self.done.clear()
        return released

    def next_deadline(self) -> float | None:
        """When a partial batch will time out (so an idle engine knows how long to sleep)."""
        if self.running or not self.waiting:
            return None
        return min(r.times.arrival for r in self.waiting) + self.config.batch_timeout_ms / 1000.0
