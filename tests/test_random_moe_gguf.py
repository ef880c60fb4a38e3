"""benchmarks/random_moe_gguf.py's Qwen3-30B-A3B layout (heads of 128 wider than hidden / heads, a
per-head q/k norm, `expert_weights_norm`) at the tiny preset's size: the file loads as qwen3_moe with
that shape and its greedy tokens are the same in a batch of two as alone."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from random_moe_gguf import PRESETS, write  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402


def test_qwen3_moe_tiny_preset_loads_and_generates(tmp_path):
    path = tmp_path / "qwen3-moe-tiny.gguf"
    write(path, {**PRESETS["qwen3-moe-tiny"], "layers": 1})
    llm = LLM(model=str(path), kv_cache_memory="16MiB", measure_kernels=False)
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("qwen3_moe", 128, 32, 4)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 8, 768)
    assert cfg.router_renormalize and cfg.qk_norm == "head" and cfg.vocab_size == 49152
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].token_ids
    both = llm.generate(["The capital of France is", "Hello"], greedy, use_tqdm=False)[0].token_ids
    assert len(alone) == 6 and alone == both
