"""The gated MLPs' activations by Hugging Face's `hidden_act` names: one table, read by the dense MLP
(model/layers.py) and the experts (model/moe.py)."""
from __future__ import annotations

import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    """The activation function of `name`; a clear error for one the decoder does not have."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]
