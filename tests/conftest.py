"""Shared fixtures: a tiny random-weight Llama saved as a Hugging Face folder, and the embedded model;
the in-process server on the tiny model that several test modules run against (`server`, `http`,
`client`).

Models are loaded once per session and shared between engines (each engine owns its own KV cache).
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton reads this when a kernel is defined, and the engine (or inductor) may import the kernel
# module before test_triton_attention.py runs: the tests only ever run Triton's interpreter
os.environ.setdefault("TRITON_INTERPRET", "1")
# kernels by the CPU's flags and fixed cut-overs, as tests assert them; tests/test_kernel_choice.py
# turns the timed choice on where it tests it (timings on a shared host would make layouts vary)
os.environ.setdefault("ITERSERVE_MEASURE_KERNELS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.config import EngineConfig  # noqa: E402

TINY_CONFIG = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    bos_token_id=1, eos_token_id=2,
)


def _save_tiny_model(folder) -> None:
    """Random weights, scaled up so that logits are peaked and greedy choices are not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from iterserve.model.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, 1.0 if "embed" in name else 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny_model(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from iterserve.model.loader import load_model

    model, cfg, tok, _ = load_model(str(tiny_model_dir))
    return model, cfg, tok


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    """transformers' own model of the tiny folder, in float32: the reference a module compares with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_loaded():
    from iterserve.model.loader import load_model

    model, cfg, tok, _ = load_model("smollm2-135m")
    return model, cfg, tok


# ---- the C++ CPU kernels' builds: the native one, and the AVX2 one on an AVX-512 host ------------------------
def variant_skip_reason(variant: str) -> str | None:
    """Why this CPU does not test a kernel build (cpu_kernels.VARIANTS), or None: it lacks the
    variant's instructions, or the variant is what the native build is here already."""
    from iterserve.cpu_info import cpu_flags
    from iterserve.platform.cpu_kernels import VARIANT_NEEDS

    missing = VARIANT_NEEDS[variant] - cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))} for the {variant} build"
    if variant == "avx2" and "avx512f" not in cpu_flags():
        return "no AVX-512 here: the native build runs the AVX2 paths already"
    if variant == "amx-no-vbmi" and "avx512vbmi" not in cpu_flags():
        return "no AVX512-VBMI here: the native build runs the paths without it already"
    return None


@pytest.fixture(scope="session", params=["native", "avx2"])
def kernel_variant(request) -> str:
    """The kernel builds this CPU can test: native always; avx2 (lanes.h's AVX2 + FMA branches, what a
    Zen 3 CI host builds) where the CPU has AVX2 + FMA + F16C and the native build is AVX-512, so that
    the AVX2 paths run in tests on every CI host, not only where they are the native ones."""
    reason = variant_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="session")
def variant_kernels(kernel_variant):
    """The kernels module of `kernel_variant` (built once, ~1-3 min for avx2; cached by torch after),
    checked to be the build it says: a variant that compiled the AVX-512 branches would pass vacuously."""
    from iterserve.platform.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels(kernel_variant)
    if kernels is None:
        pytest.skip(f"the {kernel_variant} CPU kernels did not build here (see the log)")
    if kernel_variant == "avx2":
        assert kernels.lanes_isa() == "avx2"
    return kernels


@pytest.fixture
def make_engine(tiny_loaded):
    """make_engine(**EngineConfig fields, loaded=...) -> LLMEngine over a shared model."""
    from iterserve.engine import LLMEngine

    def make(loaded=None, **kw):
        kw.setdefault("kv_cache_memory", "64MiB")
        return LLMEngine(EngineConfig(**kw), loaded=loaded or tiny_loaded)

    return make


# ---- one in-process `iterserve serve` app per test module, on the tiny model ----------------------------
# A module that uses `server` (or `http`, `client`) says how the server starts in SERVE_ARGS (the flags after
# the model); a module whose server differs (a process, other models) defines its own fixture of that name.
@pytest.fixture(scope="module")
def server(request, tiny_model_dir, tiny_loaded):
    """The app `iterserve serve` builds, over httpx's ASGI transport (tests/app_server.py), with the
    test module's SERVE_ARGS; the tiny model is shared, the engine and its KV cache are the module's."""
    from app_server import AppServer

    with AppServer([str(tiny_model_dir), *request.module.SERVE_ARGS], tiny_loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """A synchronous httpx client of `server`."""
    with server.client(timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    """The official openai client, on `server`."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         http_client=server.client(timeout=60))
