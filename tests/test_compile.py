"""--compile: the inductor-compiled decoder gives the eager engine's greedy tokens, on a workload
whose steps mix prefill chunks and decodes of many sizes, and compiles once per token-count class
(one token; more than one), not once per step."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.model.loader import load_model
from iterserve.sampling import SamplingParams


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    for i, n in enumerate([5, 40, 3, 70, 17, 1]):
        ids = [100 + (37 * i + 11 * j) % 3000 for j in range(n)]
        engine.add_request(prompt_token_ids=ids, request_id=f"r{i}",
                           params=SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.slow
def test_compiled_decoder_matches_eager(tiny_model_dir, tiny_loaded):
    kw = dict(kv_cache_memory="64MiB", max_num_batched_tokens=64, dtype="float32")
    eager = _run(LLMEngine(EngineConfig(**kw), loaded=tiny_loaded))
    counters.clear()
    model, cfg, tok, _ = load_model(str(tiny_model_dir))  # its own copy: compiling changes the model
    engine = LLMEngine(EngineConfig(**kw), loaded=(model, cfg, tok))
    model.compile_decoder()
    engine.runner.warm_up()
    compiled = _run(engine)
    assert compiled == eager
    assert sum(len(v) for v in compiled.values()) == sum(6 + 3 * i for i in range(6))
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.slow
def test_two_compiled_models_in_one_process_keep_their_own_graphs(tiny_model_dir):
    """dynamo keeps its graphs on the function's code object and the parameters are unguarded:
    without a code object per model, the second model here (one layer fewer) would run the first's
    graph and give the first model's tokens."""
    kw = dict(kv_cache_memory="64MiB", max_num_batched_tokens=64, dtype="float32")
    runs = []
    for drop_last_layer in (False, True):
        model, cfg, tok, _ = load_model(str(tiny_model_dir))
        if drop_last_layer:
            model.layers = model.layers[:-1]
        eager = _run(LLMEngine(EngineConfig(**kw), loaded=(model, cfg, tok)))
        engine = LLMEngine(EngineConfig(**kw), loaded=(model, cfg, tok))
        model.compile_decoder()
        engine.runner.warm_up()
        runs.append((eager, _run(engine)))
    assert runs[0][0] != runs[1][0]  # the two models really differ
    for eager, compiled in runs:
        assert compiled == eager


@pytest.mark.slow
def test_compile_flag_compiles_at_startup(tiny_model_dir):
    model, cfg, tok, _ = load_model(str(tiny_model_dir))
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", dtype="float32", compile=True), loaded=(model, cfg, tok))
    assert model._compiled_stack is not None
    with torch.inference_mode():
        assert _run(engine)["r0"]  # and it serves


def test_compile_refuses_a_model_without_a_decoder_stack(tiny_loaded):
    class Opaque(torch.nn.Module):
        def forward(self, *a):
            raise AssertionError("never run")

    _, cfg, tok = tiny_loaded
    with pytest.raises(ValueError, match="compile_decoder"):
        LLMEngine(EngineConfig(kv_cache_memory="64MiB", compile=True), loaded=(Opaque(), cfg, tok))


def test_forward_context_is_per_thread():
    """Two engines stepping in two threads of one process each read their own step's metadata."""
    import threading

    from iterserve.attention.backend import TorchAttentionBackend
    from iterserve.attention.forward_context import forward_context, get_forward_context

    both_open, both_read, seen = threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10), {}

    def step(name: str) -> None:
        with forward_context(name, [], TorchAttentionBackend()):
            both_open.wait()  # the two contexts are set at the same time
            seen[name] = get_forward_context().meta
            both_read.wait()

    threads = [threading.Thread(target=step, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {"a": "a", "b": "b"}
    with pytest.raises(RuntimeError, match="outside forward_context"):
        get_forward_context()


# ---- --omp-wait: the OpenMP environment is set before torch loads -------------------------------------
def _env_after(args: str, env: dict[str, str]) -> dict[str, str]:
    import json
    import os
    import subprocess
    import sys

    code = ("import json, os, sys\nfrom iterserve import cli\n"
            f"a = cli.build_parser().parse_args({args.split()!r})\ncli.apply_omp_wait(a.omp_wait)\n"
            "import torch\n"
            "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # Python processes
def test_omp_wait_passive_by_default_and_an_exported_policy_wins():
    assert _env_after("generate", {}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    assert _env_after("serve", {}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    assert _env_after("generate", {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.slow  # Python processes
def test_omp_wait_spin_overrides_the_environment():
    got = _env_after("serve --omp-wait spin", {"OMP_WAIT_POLICY": "PASSIVE"})
    assert got == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}


@pytest.mark.slow  # Python processes
def test_importing_iterserve_before_torch_sets_passive_for_the_in_process_api():
    """The in-process API gets the CLI's default too: `import iterserve` fills OMP_WAIT_POLICY before
    torch loads (an exported value wins); where torch loaded first with none set, the CPU platform
    says so, once."""
    import json
    import os
    import subprocess
    import sys

    def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        return subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True, check=True)

    show = "print(json.dumps(os.environ.get('OMP_WAIT_POLICY')))"
    first = "import json, os\nimport iterserve\nimport torch\n" + show
    assert json.loads(run(first, {}).stdout) == "PASSIVE"
    assert json.loads(run(first, {"OMP_WAIT_POLICY": "ACTIVE"}).stdout) == "ACTIVE"
    late = ("import json, os, logging\nimport torch\nlogging.basicConfig()\n"
            "from iterserve.platform.cpu import warn_spinning_openmp\n"
            "print(json.dumps([warn_spinning_openmp(), warn_spinning_openmp(), os.environ.get('OMP_WAIT_POLICY')]))")
    out = run(late, {})
    assert json.loads(out.stdout) == [True, True, None]
    assert out.stderr.count("OMP_WAIT_POLICY is unset and torch was loaded before iterserve") == 1
    out = run(late, {"OMP_WAIT_POLICY": "PASSIVE"})
    assert json.loads(out.stdout) == [False, False, "PASSIVE"] and "OMP_WAIT_POLICY" not in out.stderr
