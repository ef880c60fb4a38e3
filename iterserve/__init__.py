"""iterserve: an LLM serving engine built around continuous batching and a paged KV cache.

Importing the package sets OMP_WAIT_POLICY=PASSIVE where the environment leaves it unset and torch
is not loaded yet (libgomp reads it once, when torch loads): the default of the CLI's --omp-wait, so
that the in-process API (iterserve.llm.LLM) runs as the server does. The C++ kernels run on their own
pool (csrc/work_pool.h); torch's OpenMP threads, left spinning after a small parallel torch op (the
q/k/v outputs' gather, say), held the second core of a 2-core host while that pool wanted it: a 1B
Q4_K_M's 16-row decode step took 93 ms instead of 70 (2-core AMX Xeon; docs/profile.md, Method).
An exported value wins; platform.cpu warns where torch was loaded first with none set.
"""
import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
