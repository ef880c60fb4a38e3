"""When to call a custom op's Python kernel straight, not through torch's dispatcher.

`iterserve::cpu_linear` and `iterserve::paged_attention` are custom ops so that torch.compile treats
them as opaque (inductor cannot lower a packed weight or the paged KV cache). In eager runs the
dispatcher's round trip into their Python kernels is pure overhead: ~30 us a call on a 2-core Zen 3
(SmolLM2 makes 121 projection calls and 30 attention calls a decode step, ~4 ms of a 28 ms step).
So the modules call the kernel function itself unless a graph is being traced, or the profiler is
recording (benchmarks/profile_step.py counts time by op name, which only the op carries).
"""
from __future__ import annotations

import torch


def call_directly() -> bool:
    """True in eager runs without the profiler: call the op's kernel function, not torch.ops."""
    return not torch.compiler.is_compiling() and not torch._C._autograd._profiler_enabled()
