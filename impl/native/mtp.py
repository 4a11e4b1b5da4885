"""The multi-token-prediction layer ``mtp.layers.0`` (``docs/reference/v4_architecture.md`` §5.10).

Input: the main model's final stream tensor ``X [B, S, n, d]`` (before ``hc_head``) and the next-token ids.
``X0 = e_proj(enorm(embed(ids)))`` broadcast over the streams ``+ h_proj(hnorm(X))``, one decoder layer
(sliding-window attention, score-routed MoE), then its own ``hc_head`` and ``final_layernorm``; the embedding
and the output head are the main model's (passed in). transformers has no MTP, so there is no oracle."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from impl.native.activations import ActivationPlan
from impl.native.config import V4Config
from impl.native.hyper import HyperHead
from impl.native.layer import DeepseekV4DecoderLayer
from impl.native.norm import ReplicatedLinear, RMSNorm

__all__ = [
    "DeepseekV4MTPBlock",
    "DeepseekV4MTPLayer",
]


class DeepseekV4MTPLayer(nn.Module):
    """``enorm``, ``hnorm``, ``e_proj [d, d]``, ``h_proj [d, d]``, ``mtp_model_layer``, ``hc_head_params``, ``final_layernorm``."""

    def __init__(
        self,
        config: V4Config,
        mtp_index: int = 0,
        *,
        tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        activations: ActivationPlan | None = None,
    ) -> None:
        super().__init__()
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps, params_dtype=params_dtype)
        self.hnorm = RMSNorm(d, config.rms_norm_eps, params_dtype=params_dtype)
        self.e_proj = ReplicatedLinear(d, d, params_dtype=params_dtype, init_std=0.02)
        self.h_proj = ReplicatedLinear(d, d, params_dtype=params_dtype, init_std=0.02)
        # The MTP block is "layer num_layers + index": window-only attention (ratio 0), score routing.
        self.mtp_model_layer = DeepseekV4DecoderLayer(
            config,
            config.num_layers + mtp_index,
            compress_ratio=0,
            hash_layer=False,
            tp_group=tp_group,
            ep_group=ep_group,
            params_dtype=params_dtype,
            activations=activations,
        )
        self.hc_head_params = HyperHead(config)
        self.final_layernorm = RMSNorm(d, config.rms_norm_eps, params_dtype=params_dtype)

    def forward(
        self,
        hidden_streams: torch.Tensor,
        next_input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``(X [B,S,n,d], ids [B,S])`` -> normalized hidden ``[B, S, d]`` ready for the shared output head."""
        e = self.e_proj(self.enorm(embed(next_input_ids)))
        x0 = e.unsqueeze(2) + self.h_proj(self.hnorm(hidden_streams))
        x1 = self.mtp_model_layer(x0, next_input_ids, position_ids)
        return self.final_layernorm(self.hc_head_params(x1))


class DeepseekV4MTPBlock(nn.Module):
    """``layers`` = the ``num_mtp_layers`` MTP layers (V4 ships one)."""

    def __init__(self, config: V4Config, **kwargs: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DeepseekV4MTPLayer(config, i, **kwargs) for i in range(config.num_mtp_layers))
