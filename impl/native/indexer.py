"""Lightning indexer of the CSA layers (``docs/reference/v4_architecture.md`` §5.5).

It scores every compressed entry for every query, hides entries a query may not see yet and returns the top-k entry
indices per query (:class:`Indexer`). Op order, and therefore ``topk``'s tie handling, follows transformers'
``DeepseekV4Indexer`` / ``DeepseekV4IndexerScorer``. The indices are integers: no gradient reaches the indexer
through attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl.native.compressor import Compressor
from impl.native.config import INDEXER_RATIO, V4Config
from impl.native.norm import ReplicatedLinear
from impl.native.rope import apply_interleaved_rope, rope_cos_sin

__all__ = ["INDEXER_RATIO", "Indexer"]


class Indexer(nn.Module):
    """Replicated indexer: ``linear_wq_b [IH*ID, Q]``, ``linear_weights_proj [IH, d]``, ``compressor`` (ratio 4,
    overlap).

    Scores every compressed entry for every query, ``score[t, w] = sum_h wI[t, h] * relu(qI[t, h] . K_w) / sqrt(ID)``
    with ``wI = weights_proj(x) / sqrt(IH)``, hides entries a query may not see yet (``w >= (pos + 1) // 4``) and
    returns the top ``min(index_topk, #entries)`` entry indices per query, ``-1`` where a pick is not visible.
    """

    def __init__(
        self, cfg: V4Config, *, params_dtype: torch.dtype = torch.float32, init_std: float | None = None
    ) -> None:
        super().__init__()
        self.num_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.ratio = INDEXER_RATIO
        self.linear_wq_b = ReplicatedLinear(
            cfg.q_lora_rank, self.num_heads * self.head_dim, params_dtype=params_dtype, init_std=init_std
        )
        self.linear_weights_proj = ReplicatedLinear(
            cfg.hidden_size, self.num_heads, params_dtype=params_dtype, init_std=init_std
        )
        self.compressor = Compressor(
            cfg.hidden_size,
            self.head_dim,
            self.ratio,
            overlap=True,
            eps=cfg.rms_norm_eps,
            params_dtype=params_dtype,
            init_std=init_std,
        )

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``x [B,S,d]``, ``qr [B,S,Q]``, ``positions [B|1, S]`` -> top-k entry indices ``[B, S, k]`` (``-1`` = none).

        The result is integer: no gradient flows back through the indexer (nor does it in transformers), so it runs
        without autograd and keeps nothing for backward."""
        with torch.no_grad():
            return self._picks(x, qr, positions, inv_freq)

    def _picks(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        keys = self.compressor(x, inv_freq)  # [B, T, ID]
        cos, sin = rope_cos_sin(inv_freq, positions, x.dtype)
        # [B, IH, S, ID] while rotating, then back: the same strides as transformers, so the same matmul kernel.
        q = self.linear_wq_b(qr).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = apply_interleaved_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)).transpose(1, 2)
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [B, S, IH, T]
        scores = F.relu(scores) * self.head_dim**-0.5
        weights = self.linear_weights_proj(x).float() * self.num_heads**-0.5  # [B, S, IH]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, S, T]
        n_entries = keys.shape[1]
        top_k = min(self.index_topk, n_entries)
        if n_entries == 0:
            return scores.topk(top_k, dim=-1).indices
        visible_entries = (positions + 1) // self.ratio  # [B|1, S]
        entry = torch.arange(n_entries, device=x.device)
        scores = scores.masked_fill(entry.view(1, 1, -1) >= visible_entries.unsqueeze(-1), float("-inf"))
        picks = scores.topk(top_k, dim=-1).indices
        return torch.where(picks >= visible_entries.unsqueeze(-1), torch.full_like(picks, -1), picks)
