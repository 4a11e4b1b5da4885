"""The native graph's view of a DeepSeek-V4 configuration.

:class:`V4Config` is derived once from a transformers ``DeepseekV4Config`` (or its ``config.json``
dict) and is the only configuration the native modules read. Field names follow the official
inference ``ModelArgs`` where one exists (``docs/reference/v4_architecture.md`` §2.2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "V4Config",
]

LAYER_TYPE_RATIO_KEYS = ("compressed_sparse_attention", "heavily_compressed_attention")
#: compress ratio of the CSA layers, the only ones that carry a lightning indexer
INDEXER_RATIO = 4


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]  # one per decoder layer (MTP layers are ratio 0)
    num_hash_layers: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnParams | None
    num_mtp_layers: int
    tie_word_embeddings: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hc_mix_dim(self) -> int:
        """Rows of ``hc_*_fn``: pre (n) + post (n) + residual mixing (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def min_seq_len(self) -> int:
        """Shortest sequence on which every layer kind of this model does its real work.

        Twice the sliding window (so the window slides); every compressed layer emits at least two entries;
        an indexer layer emits ``2 * index_topk + 1`` so its top-k really chooses. Rounded up to a multiple of
        every compress ratio in use, so each compressor ends on a whole block.
        """
        need, step = 2 * self.window_size, 1
        for ratio in sorted(set(self.compress_ratios) - {0}):
            entries = 2 * self.index_topk + 1 if ratio == INDEXER_RATIO else 2
            need, step = max(need, ratio * entries), math.lcm(step, ratio)
        return -(-need // step) * step

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @classmethod
    def from_hf(cls, hf_config: Any) -> V4Config:
        """Build from a transformers ``DeepseekV4Config`` (legacy keys already folded in)."""
        c = hf_config
        rates = dict(getattr(c, "compress_rates", None) or {})
        ratio_of = {"sliding_attention": 0, **{k: int(rates[k]) for k in LAYER_TYPE_RATIO_KEYS if k in rates}}
        ratios = tuple(ratio_of[t] for t in c.layer_types)
        hash_layers = 0
        for t in c.mlp_layer_types:
            if t != "hash_moe":
                break
            hash_layers += 1
        if "hash_moe" in c.mlp_layer_types[hash_layers:]:
            raise ValueError(f"hash_moe layers must be a prefix of mlp_layer_types, got {c.mlp_layer_types}")
        rope = getattr(c, "rope_parameters", None) or {}
        compress = rope.get("compress", {}) if isinstance(rope, Mapping) else {}
        yarn = None
        if compress.get("rope_type") == "yarn":
            yarn = YarnParams(
                factor=float(compress["factor"]),
                original_max_position_embeddings=int(compress["original_max_position_embeddings"]),
                beta_fast=float(compress.get("beta_fast", 32.0)),
                beta_slow=float(compress.get("beta_slow", 1.0)),
            )
        main = rope.get("main", {}) if isinstance(rope, Mapping) else {}
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            head_dim=c.head_dim,
            rope_head_dim=int(c.qk_rope_head_dim),
            q_lora_rank=c.q_lora_rank,
            o_groups=c.o_groups,
            o_lora_rank=c.o_lora_rank,
            window_size=c.sliding_window,
            compress_ratios=ratios,
            num_hash_layers=hash_layers,
            n_routed_experts=c.n_routed_experts,
            n_shared_experts=c.n_shared_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            routed_scaling_factor=float(c.routed_scaling_factor),
            norm_topk_prob=bool(c.norm_topk_prob),
            scoring_func=c.scoring_func,
            swiglu_limit=float(c.swiglu_limit),
            hc_mult=c.hc_mult,
            hc_sinkhorn_iters=c.hc_sinkhorn_iters,
            hc_eps=float(c.hc_eps),
            rms_norm_eps=float(c.rms_norm_eps),
            index_n_heads=c.index_n_heads,
            index_head_dim=c.index_head_dim,
            index_topk=c.index_topk,
            rope_theta=float(main.get("rope_theta", c.rope_theta)),
            compress_rope_theta=float(compress.get("rope_theta", c.compress_rope_theta)),
            yarn=yarn,
            num_mtp_layers=int(getattr(c, "num_nextn_predict_layers", 0) or 0),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        )
