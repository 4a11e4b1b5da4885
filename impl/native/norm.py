"""Small replicated building blocks shared by the native V4 modules.

:class:`RMSNorm` reproduces transformers' ``DeepseekV4RMSNorm`` op for op (fp32 statistics, cast back to the
input dtype, then the weight). :class:`ReplicatedLinear` is a bias-free linear whose only parameter is
``.weight`` (so native names end in ``.weight``); every TP rank holds the full matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "RMSNorm",
    "ReplicatedLinear",
]


class RMSNorm(nn.Module):
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``; weight starts at ones."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last dim (transformers' ``DeepseekV4UnweightedRMSNorm``)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class ReplicatedLinear(nn.Module):
    """Bias-free ``y = x @ weight^T`` held in full on every rank (no TP split, no collectives)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        with torch.no_grad():
            if init_std is None:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            else:
                nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
