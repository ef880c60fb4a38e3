"""What a Ray replica pays for the ingress's dashboard (serve_ray/dashboard_feed.py), in process:
the engine thread's cost per step (EngineTicks' listener: one lock and one append) and the
replica's event loop's cost per routing-stats report (one tick over the steps since the last
report, the block map copied and, when it changed, rebuilt, the last 25 ticks listed), plus the
size the report grows by. The engine and its pool are stand-ins with a realistic block map
(`--requests` running requests of `--blocks-per-request` blocks); no model runs.

    .venv/bin/python benchmarks/dashboard_feed_cost.py
"""
from __future__ import annotations

import argparse
import pickle
import time
import timeit
from types import SimpleNamespace

from iterserve.core.block_pool import BlockPool
from iterserve.engine import StepRecord
from iterserve.serve_ray.dashboard_feed import ReplicaFeed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=2912)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks-per-request", type=int, default=30)
    ap.add_argument("--steps-per-report", type=int, default=40, help="200 steps/s at a 0.2 s stats period")
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()

    pool = BlockPool(args.num_blocks, 16, enable_caching=True)
    for i in range(args.requests):
        pool.allocate(f"r{i}", 16 * args.blocks_per_request)
    used = args.requests * args.blocks_per_request
    state = SimpleNamespace(step_count=0, running=args.requests, waiting=0,
                            kv=SimpleNamespace(used_blocks=used, total_blocks=args.num_blocks, tokens_stored=16 * used))
    engine = SimpleNamespace(step_listeners=[], finish_listeners=[], shutting_down=False, state=state,
                             engine=SimpleNamespace(start_time=time.monotonic(), pool=pool),
                             busy_fraction=lambda: 1.0, call_in_engine_thread=lambda fn: fn())
    feed = ReplicaFeed(engine, {"step_limit": args.requests})
    feed.report(time.monotonic())
    on_step = engine.step_listeners[0]
    rec = StepRecord(step=1, start=0.0, duration=0.05, batch_size=args.requests, num_padding=0,
                     num_running=args.requests, num_waiting=0, prefill_tokens=0, decode_tokens=args.requests,
                     kv_used_blocks=used, kv_total_blocks=args.num_blocks, kv_tokens=16 * used)

    n = 100 * args.repeat
    per_step = timeit.timeit(lambda: on_step(rec), number=n) / n
    feed.ticks._pending.clear()

    def report(changed: bool) -> dict:
        for _ in range(args.steps_per_report):
            on_step(rec)
        if changed:
            feed.ticks._sent_map = None  # under load the tables change between reports: rebuilt
        return feed.report(time.monotonic())

    unchanged = timeit.timeit(lambda: report(False), number=args.repeat) / args.repeat
    changed = timeit.timeit(lambda: report(True), number=args.repeat) / args.repeat
    size = len(pickle.dumps(report(True)))
    print(f"engine thread, per step: {per_step * 1e6:.2f} us")
    print(f"replica loop, per report ({args.steps_per_report} steps, {used} held blocks): "
          f"{unchanged * 1e6:.0f} us (map unchanged), {changed * 1e6:.0f} us (map changed)")
    print(f"report grows by {size / 1024:.1f} KiB (pickled)")


if __name__ == "__main__":
    main()
