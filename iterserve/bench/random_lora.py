"""Random LoRA adapters made with PEFT on a Hugging Face model folder, for tests and benchmarks.

PEFT initialises lora_B to zero (a fresh adapter changes nothing), so both halves are drawn at
random here: the adapter then moves the model's outputs, and a test comparing against PEFT's
merged model can fail. Needs `peft` (a dev dependency), imported only when called.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_TARGETS
    use_rslora: bool = False
    std: float = 0.1  # of A and B's entries
    extra: dict = field(default_factory=dict)  # more LoraConfig fields (tests of refusals)


def make_random_adapter(model_or_folder, out: str | Path, spec: AdapterSpec, seed: int) -> Path:
    """Saves a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) at `out`.
    `model_or_folder`: a transformers causal LM (not modified: PEFT wraps a copy) or its folder."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = (AutoModelForCausalLM.from_pretrained(model_or_folder, torch_dtype=torch.float32)
            if isinstance(model_or_folder, (str, Path)) else copy.deepcopy(model_or_folder))
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                     use_rslora=spec.use_rslora, lora_dropout=0.0, **spec.extra)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.std)
    model.save_pretrained(str(out))
    return Path(out)


def merged_model(base_folder, adapter: str | Path):
    """transformers model with the adapter merged into its weights (PEFT's merge_and_unload), float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()


@torch.no_grad()
def greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' generate(), greedy, never stopping at EOS: what iterserve's ignore_eos runs."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
