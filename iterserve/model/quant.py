"""Weight-only int8 linears for CPU decoding, chosen per batch size.

A decode step at batch 1 is bound by reading the weights: int8 halves the bytes of bf16 and
torch's CPU kernel (`_weight_int8pack_mm`, per-output-channel scales, bf16 activations) runs at
about twice bf16's speed there. At larger batches the step is bound by arithmetic, where oneDNN's
bf16 GEMM (AVX512-BF16 / AMX) is several times faster than the int8 kernel. So each layer keeps
both and picks by the number of rows: `int8` below `max_int8_rows`, bf16 at and above it.
"""
from __future__ import annotations

import torch
from torch import nn


class Int8DualLinear(nn.Module):
    def __init__(self, linear: nn.Linear, max_int8_rows: int = 4) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        self.register_buffer("w_int8", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("w_bf16", linear.weight.detach().to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16))
        self.max_int8_rows = max_int8_rows
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if x.shape[0] < self.max_int8_rows:
            y = torch._weight_int8pack_mm(x, self.w_int8, self.scale)
            return y if self.bias is None else y + self.bias
        return nn.functional.linear(x, self.w_bf16, self.bias)


def quantize_int8(model: nn.Module, max_int8_rows: int = 4) -> nn.Module:
    """Replaces every projection and the LM head by an Int8DualLinear (model must be bf16)."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8DualLinear(mod, max_int8_rows))
    return model
