"""KV compressor of the compressed-attention layers (``docs/reference/v4_architecture.md`` §5.4).

Every closed window of ``ratio`` tokens becomes one entry; with overlap, on CSA layers, an entry pools two windows
(:class:`Compressor`). Prefill only: the incomplete tail window is dropped. Op order follows transformers'
``DeepseekV4{HCA,CSA}Compressor``."""

from __future__ import annotations

import torch
from torch import nn

from impl.native.norm import ReplicatedLinear, RMSNorm
from impl.native.rope import apply_interleaved_rope, rope_cos_sin

__all__ = ["Compressor"]


class Compressor(nn.Module):
    """Replicated compressor: params ``ape [ratio, c*head_dim]`` (fp32), ``wkv``/``wgate`` ``[c*head_dim, d]``,
    ``norm``.

    Every closed window of ``ratio`` tokens becomes one entry: a per-channel softmax-gated sum over the window's
    slots, RMS-normalized, with the compress RoPE at position ``w * ratio``. With overlap (ratio 4, CSA) each token
    projects two series ``[Ca | Cb]`` and entry ``w`` pools window ``w-1``'s Ca with window ``w``'s Cb over
    ``2 * ratio`` slots (window 0's Ca half is zero-kv / -inf-gate). Prefill only: the incomplete tail window is
    dropped.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        *,
        overlap: bool,
        eps: float,
        params_dtype: torch.dtype = torch.float32,
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        if ratio <= 0:
            raise ValueError(f"Compressor needs a positive compress ratio, got {ratio}")
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap
        width = (2 if overlap else 1) * head_dim
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))  # kept fp32 like the checkpoint
        self.wkv = ReplicatedLinear(hidden_size, width, params_dtype=params_dtype, init_std=init_std)
        self.wgate = ReplicatedLinear(hidden_size, width, params_dtype=params_dtype, init_std=init_std)
        self.norm = RMSNorm(head_dim, eps, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``x [B, S, d]`` -> compressed entries ``[B, S // ratio, head_dim]`` (compress RoPE applied)."""
        batch = x.shape[0]
        kv = self.wkv(x)
        gate = self.wgate(x)
        n_windows = x.shape[1] // self.ratio
        if n_windows == 0:
            return kv.new_zeros((batch, 0, self.head_dim))
        usable = n_windows * self.ratio
        kv = kv[:, :usable].view(batch, n_windows, self.ratio, -1)
        gate = gate[:, :usable].view(batch, n_windows, self.ratio, -1) + self.ape
        if self.overlap:
            m, hd = self.ratio, self.head_dim
            slots_kv = kv.new_zeros((batch, n_windows, 2 * m, hd))
            slots_gate = gate.new_full((batch, n_windows, 2 * m, hd), float("-inf"))
            slots_kv[:, :, m:] = kv[..., hd:]
            slots_gate[:, :, m:] = gate[..., hd:]
            if n_windows > 1:
                slots_kv[:, 1:, :m] = kv[:, :-1, :, :hd]
                slots_gate[:, 1:, :m] = gate[:, :-1, :, :hd]
            kv, gate = slots_kv, slots_gate
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)  # per channel, over the slots
        compressed = self.norm((kv * weights).sum(dim=2))
        positions = (torch.arange(n_windows, device=x.device) * self.ratio).unsqueeze(0).expand(batch, -1)
        cos, sin = rope_cos_sin(inv_freq, positions, compressed.dtype)
        return apply_interleaved_rope(compressed, cos, sin)
