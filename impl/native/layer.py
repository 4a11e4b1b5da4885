"""The DeepSeek-V4 decoder layer on the hyper-connection stream (``docs/reference/v4_architecture.md`` §5.9).

``X [B, S, n, d]`` -> attention site -> FFN site -> ``X'``; each site is ``hc_pre`` (collapse the streams),
``RMSNorm``, the block, ``hc_post`` (place the output and mix the streams), op for op as transformers'
``DeepseekV4DecoderLayer``. The hyper-connection parameters live on the layer: ``hc_{attn,ffn}_{fn,base,scale}``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from impl.native.activations import ActivationPlan, recompute
from impl.native.attention import DeepseekV4Attention
from impl.native.config import V4Config
from impl.native.hyper import hc_post, hc_pre, register_hc_params
from impl.native.moe import V4MoE
from impl.native.norm import RMSNorm
from impl.native.parallel import place_on_init_device

__all__ = [
    "DeepseekV4DecoderLayer",
]


class DeepseekV4DecoderLayer(nn.Module):
    """Decoder layer ``layer_number`` (0-based, global). ``compress_ratio`` / ``hash_layer`` override the config's."""

    def __init__(
        self,
        config: V4Config,
        layer_number: int,
        *,
        compress_ratio: int | None = None,
        hash_layer: bool | None = None,
        tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        activations: ActivationPlan | None = None,
    ) -> None:
        super().__init__()
        self.activations = activations or ActivationPlan()
        self.layer_number = layer_number
        self.hc_mult = config.hc_mult
        self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.hash_layer = config.is_hash_layer(layer_number) if hash_layer is None else bool(hash_layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)
        self.self_attention = DeepseekV4Attention(
            config,
            layer_number,
            compress_ratio=compress_ratio,
            tp_group=tp_group,
            params_dtype=params_dtype,
            activations=self.activations,
        )
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)
        self.mlp = V4MoE(
            config,
            hash_routed=self.hash_layer,
            ep_group=ep_group,
            tp_group=tp_group,
            params_dtype=params_dtype,
            recompute_activation=self.activations.selective("moe_act"),
        )
        register_hc_params(self, "attn", config)
        register_hc_params(self, "ffn", config)
        place_on_init_device(self)

    def _hc_pre(self, x: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mix = partial(
            hc_pre,
            hc_mult=self.hc_mult,
            sinkhorn_iters=self.hc_sinkhorn_iters,
            hc_eps=self.hc_eps,
            norm_eps=self.norm_eps,
        )
        params = (getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"))
        # selective 'mhc': drop the fp32 copies of the flattened streams, recompute them in backward
        return recompute(self.activations.selective("mhc"), mix, x, *params)

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Streams ``[B, S, n, d]`` -> streams; ``input_ids [B, S]`` feed the hash router (hash layers only)."""
        if hidden_states.dim() != 4 or hidden_states.shape[2] != self.hc_mult:
            raise ValueError(
                f"layer {self.layer_number}: expected the stream tensor [B, S, hc_mult={self.hc_mult}, d], "
                f"got shape {tuple(hidden_states.shape)}"
            )
        post, comb, collapsed = self._hc_pre(hidden_states, "attn")
        attn_out = self.self_attention(self.input_layernorm(collapsed), position_ids)
        hidden_states = hc_post(hidden_states, attn_out, post, comb)

        post, comb, collapsed = self._hc_pre(hidden_states, "ffn")
        mlp_out = self.mlp(self.pre_mlp_layernorm(collapsed), input_ids)
        return hc_post(hidden_states, mlp_out, post, comb)
