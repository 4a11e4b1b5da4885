"""Hypothesis strategy for VALID random tiny DeepSeek-V4 configs, built constructively (no filtering).

``v4_configs()`` draws a frozen :class:`V4Spec`; ``spec.to_config()`` (or :func:`build_config`) turns it
into a ``DeepseekV4Config``. Every size is capped by :data:`CAPS`. ``tp_divisible=N`` makes every tensor-
or expert-parallel split dimension (heads, o_groups, indexer heads, experts, vocab) divisible by ``N``.
Invariants held by construction (docs/reference/v4_architecture.md §9): heads % o_groups == 0, rope_head_dim even and
< head_dim, index_head_dim >= rope_head_dim, hash layers a prefix, top-k <= experts, one shared expert.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from transformers import DeepseekV4Config

from tiny_models.presets import CSA, HCA, SLIDING, tiny_config

__all__ = ["CAPS", "SizeCaps", "V4Spec", "v4_configs", "build_config"]


@dataclasses.dataclass(frozen=True)
class SizeCaps:
    """Upper bounds of every drawn size (one place to make the generated models bigger or smaller)."""

    max_layers: int = 4
    max_hidden: int = 64
    max_heads: int = 8
    max_head_dim: int = 32
    max_experts: int = 8
    max_top_k: int = 4
    max_vocab: int = 256
    max_index_topk: int = 4
    max_hc_mult: int = 4


CAPS = SizeCaps()


@dataclasses.dataclass(frozen=True)
class V4Spec:
    """A tiny V4 architecture; :meth:`to_config` builds the transformers config."""

    layer_types: tuple[str, ...]
    num_hash_layers: int
    hca_rate: int
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    vocab_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    routed_scaling_factor: float
    swiglu_limit: float
    yarn_factor: float
    yarn_original: int
    num_nextn_predict_layers: int

    def to_config(self) -> DeepseekV4Config:
        return build_config(self)


def build_config(spec: V4Spec) -> DeepseekV4Config:
    """The fp32 ``DeepseekV4Config`` of ``spec``."""
    fields = dataclasses.asdict(spec)
    return tiny_config(
        layer_types=list(fields.pop("layer_types")),
        num_hash_layers=fields.pop("num_hash_layers"),
        hca_rate=fields.pop("hca_rate"),
        yarn_factor=fields.pop("yarn_factor"),
        yarn_original=fields.pop("yarn_original"),
        n_shared_experts=1,
        **fields,
    )


def _pow2_upto(low: int, high: int) -> list[int]:
    return [v for v in (2, 4, 8, 16, 32, 64, 128, 256, 512) if low <= v <= high]


@st.composite
def v4_configs(draw: st.DrawFn, *, tp_divisible: int = 1, caps: SizeCaps = CAPS) -> V4Spec:
    """A valid tiny V4 spec; every split dimension is a multiple of ``tp_divisible``."""
    tp = tp_divisible
    if tp < 1 or tp & (tp - 1):
        raise ValueError(f"tp_divisible={tp} must be a power of two >= 1")
    n_layers = draw(st.integers(1, caps.max_layers), label="num_hidden_layers")
    layer_types = tuple(draw(st.sampled_from((SLIDING, CSA, HCA)), label=f"layer_types[{i}]") for i in range(n_layers))
    num_hash_layers = draw(st.integers(0, n_layers), label="num_hash_layers")  # always a prefix
    hca_rate = draw(st.sampled_from((8, 16)), label="hca_rate")

    # Heads = o_groups * heads_per_group, o_groups a multiple of tp: both divisible as TP needs.
    o_groups = tp * draw(st.sampled_from([g for g in (1, 2) if g * tp <= caps.max_heads]), label="o_groups/tp")
    heads_per_group = draw(st.integers(1, max(1, caps.max_heads // o_groups)), label="heads_per_group")
    # head_dim a power of two so partial_rotary_factor = rope / head_dim is exact in binary.
    head_dim = draw(st.sampled_from(_pow2_upto(8, caps.max_head_dim)), label="head_dim")
    rope = draw(st.sampled_from(list(range(2, head_dim, 2))), label="qk_rope_head_dim")  # even, < head_dim
    index_head_dim = draw(st.sampled_from(_pow2_upto(max(8, rope), 32)), label="index_head_dim")  # >= rope
    index_n_heads = tp * draw(st.integers(1, 2), label="index_n_heads/tp")

    n_experts = tp * draw(st.integers(max(1, 2 // tp), max(1, caps.max_experts // tp)), label="experts/tp")
    top_k = draw(st.integers(1, min(n_experts, caps.max_top_k)), label="num_experts_per_tok")
    vocab = draw(st.sampled_from([v for v in _pow2_upto(64, caps.max_vocab) if v % tp == 0]), label="vocab_size")

    yarn_original = draw(st.sampled_from((16, 32, 64)), label="yarn_original")
    return V4Spec(
        layer_types=layer_types,
        num_hash_layers=num_hash_layers,
        hca_rate=hca_rate,
        hidden_size=draw(st.sampled_from(_pow2_upto(16, caps.max_hidden)), label="hidden_size"),
        num_attention_heads=o_groups * heads_per_group,
        head_dim=head_dim,
        qk_rope_head_dim=rope,
        q_lora_rank=draw(st.sampled_from((8, 16, 24, 32)), label="q_lora_rank"),
        o_groups=o_groups,
        o_lora_rank=draw(st.sampled_from((4, 8, 16)), label="o_lora_rank"),
        sliding_window=draw(st.sampled_from((4, 8, 16)), label="sliding_window"),
        vocab_size=vocab,
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=draw(st.sampled_from((8, 16, 32)), label="moe_intermediate_size"),
        index_n_heads=index_n_heads,
        index_head_dim=index_head_dim,
        index_topk=draw(st.integers(1, caps.max_index_topk), label="index_topk"),
        hc_mult=draw(st.integers(1, caps.max_hc_mult), label="hc_mult"),
        hc_sinkhorn_iters=draw(st.sampled_from((1, 3, 20)), label="hc_sinkhorn_iters"),
        routed_scaling_factor=draw(st.sampled_from((1.0, 1.5, 2.5)), label="routed_scaling_factor"),
        swiglu_limit=draw(st.sampled_from((1.0, 10.0)), label="swiglu_limit"),
        yarn_factor=draw(st.sampled_from((2.0, 4.0)), label="yarn_factor"),
        yarn_original=yarn_original,
        num_nextn_predict_layers=draw(st.integers(0, 1), label="num_nextn_predict_layers"),
    )
