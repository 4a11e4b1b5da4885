"""Manifold-constrained hyper-connections (mHC), ``docs/reference/v4_architecture.md`` §5.2.

The residual is ``hc_mult`` parallel streams ``X [B, S, n, d]``: :func:`hc_pre` turns ``X`` into a sub-block's input
and :func:`hc_post` writes the output back. All mixing math is fp32, op for op as transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``. Parameters are named ``hc_{site}_{fn,base,scale}``
(:func:`register_hc_params`); the final collapse owns ``hc_head_{fn,base,scale}`` (:class:`HyperHead`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl.native.config import V4Config

__all__ = [
    "HyperHead",
    "hc_head",
    "hc_post",
    "hc_pre",
]

_INIT_STD = 0.02


def _flat_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm of the flattened streams, in fp32 (``DeepseekV4UnweightedRMSNorm`` on ``x.float()``)."""
    flat = x.flatten(start_dim=2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_mult: int,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(post [B,S,n] fp32, comb [B,S,n,n] fp32, collapsed [B,S,d] in x.dtype)`` for streams ``x [B,S,n,d]``.

    The block input is the ``pre``-weighted sum of the streams; ``post`` holds the placement weights and ``comb`` the
    Sinkhorn-projected stream mixer, which :func:`hc_post` uses to write ``post * f + comb^T @ X`` after the block.
    """
    n = hc_mult
    mix = F.linear(_flat_rms(x, norm_eps), fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)

    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp: one column pass, then (iters - 1) row+column passes (the oracle's exact order).
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
    return post, comb, collapsed


def hc_post(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``X'_k = post_k * f + sum_j comb[j, k] * X_j`` (comb is NOT symmetric: the sum runs over j)."""
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final stream collapse ``sum_j pre_j X_j`` with ``pre = sigmoid(mix * scale + base) + eps`` -> ``[B,S,d]``."""
    mix = F.linear(_flat_rms(x, norm_eps), fn.float())
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def _fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32))


def register_hc_params(module: nn.Module, site: str, config: V4Config) -> None:
    """Add replicated fp32 ``hc_{site}_fn [(2+n)n, n*d]``, ``hc_{site}_base [(2+n)n]``, ``hc_{site}_scale [3]``.

    Initialized like transformers' ``_init_weights`` (fn ~ N(0, 0.02), base 0, scale 1).
    """
    n, mix = config.hc_mult, config.hc_mix_dim
    fn, base, scale = _fp32_param(mix, n * config.hidden_size), _fp32_param(mix), _fp32_param(3)
    with torch.no_grad():
        nn.init.normal_(fn, mean=0.0, std=_INIT_STD)
        nn.init.zeros_(base)
        nn.init.ones_(scale)
    module.register_parameter(f"hc_{site}_fn", fn)
    module.register_parameter(f"hc_{site}_base", base)
    module.register_parameter(f"hc_{site}_scale", scale)


class HyperHead(nn.Module):
    """Holds ``hc_head_{fn [n, n*d], base [n], scale [1]}`` (fp32) and collapses the streams to ``[B,S,d]``."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hc_head_fn = _fp32_param(n, n * config.hidden_size)
        self.hc_head_base = _fp32_param(n)
        self.hc_head_scale = _fp32_param(1)
        with torch.no_grad():
            nn.init.normal_(self.hc_head_fn, mean=0.0, std=_INIT_STD)
            nn.init.zeros_(self.hc_head_base)
            nn.init.ones_(self.hc_head_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hc_head(
            x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, hc_eps=self.hc_eps, norm_eps=self.norm_eps
        )
