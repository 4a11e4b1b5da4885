"""Named tiny DeepSeek-V4 configs, plus the full-size Flash / Pro configs (no weights allocated).

Together the tiny presets cover every V4 feature: sliding-only layers, CSA (ratio 4: overlapping
compressor + lightning indexer), HCA (ratio 8 / 16 / 32 via explicit ``layer_types`` + ``compress_rates``,
because transformers maps only the legacy ratios 0/4/128), hash-routed and score-routed MoE (expert bias),
a shared expert, ``o_groups >= 2``, ``hc_mult >= 2``, one MTP layer and YaRN on compressed layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from transformers import DeepseekV4Config

from tiny_models.errors import UnknownPresetError

__all__ = [
    "CSA",
    "HCA",
    "SLIDING",
    "PRESETS",
    "get_preset",
    "preset_names",
    "min_seq_len",
    "compress_ratio_of",
    "flash_config",
    "pro_config",
    "tiny_config",
]

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


def _yarn(factor: float, original: int) -> dict:
    """The legacy ``rope_scaling`` block of the published configs; transformers folds it into
    ``rope_parameters["compress"]`` (YaRN, ``attention_factor`` 1.0) and leaves ``"main"`` plain."""
    return {
        "type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": 32,
        "beta_slow": 1,
    }


def tiny_config(
    *,
    layer_types: list[str],
    num_hash_layers: int,
    hca_rate: int = 16,
    yarn_factor: float = 4.0,
    yarn_original: int = 64,
    **fields: object,
) -> DeepseekV4Config:
    """A fp32 ``DeepseekV4Config`` with an explicit attention schedule (any HCA ratio) and a hash prefix.

    ``max_position_embeddings`` is ``factor * original`` so YaRN's implicit and explicit factors agree.
    """
    n = len(layer_types)
    if not 0 <= num_hash_layers <= n:
        raise ValueError(f"num_hash_layers={num_hash_layers} must lie in [0, {n}] (hash layers are a prefix)")
    return DeepseekV4Config(
        architectures=["DeepseekV4ForCausalLM"],
        dtype="float32",
        num_hidden_layers=n,
        layer_types=list(layer_types),
        compress_rates={CSA: 4, HCA: hca_rate},
        mlp_layer_types=["hash_moe"] * num_hash_layers + ["moe"] * (n - num_hash_layers),
        rope_scaling=_yarn(yarn_factor, yarn_original),
        max_position_embeddings=int(yarn_factor * yarn_original),
        **fields,
    )


def _tiny_mixed() -> DeepseekV4Config:
    # The cross-checked config of docs/reference/v4_architecture.md §9: sliding/hash, CSA/hash, HCA(16), CSA.
    return tiny_config(
        layer_types=[SLIDING, CSA, HCA, CSA],
        num_hash_layers=2,
        hca_rate=16,
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=48,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        routed_scaling_factor=1.5,
        num_nextn_predict_layers=1,
    )


def _tiny_tp() -> DeepseekV4Config:
    # Everything that TP=2 / EP=2 splits is even: heads, o_groups, experts, vocab, indexer heads.
    # Layer 0 is CSA + hash (the Flash layer-2 template); HCA ratio 8; swiglu_limit low so the clamp bites.
    return tiny_config(
        layer_types=[CSA, SLIDING, HCA, CSA],
        num_hash_layers=1,
        hca_rate=8,
        yarn_factor=2.0,
        yarn_original=64,
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=8,
        head_dim=16,
        qk_rope_head_dim=4,
        q_lora_rank=32,
        o_groups=4,
        o_lora_rank=8,
        sliding_window=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=2,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        routed_scaling_factor=2.5,
        swiglu_limit=1.0,
        num_nextn_predict_layers=1,
    )


def _tiny_sliding() -> DeepseekV4Config:
    # Window-only attention (no compressor), one hash layer then one score-routed layer, o_groups 1.
    return tiny_config(
        layer_types=[SLIDING, SLIDING],
        num_hash_layers=1,
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=2,
        head_dim=16,
        qk_rope_head_dim=4,
        q_lora_rank=16,
        o_groups=1,
        o_lora_rank=8,
        sliding_window=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_nextn_predict_layers=1,
    )


def _tiny_largest() -> DeepseekV4Config:
    # The biggest preset (benchmarks): Flash-like schedule [0,0] + [4,32]*2, three hash layers.
    return tiny_config(
        layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA],
        num_hash_layers=3,
        hca_rate=32,
        yarn_factor=8.0,
        yarn_original=64,
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=8,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=96,
        o_groups=4,
        o_lora_rank=32,
        sliding_window=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        n_shared_experts=1,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        num_nextn_predict_layers=1,
    )


PRESETS: dict[str, Callable[[], DeepseekV4Config]] = {
    "tiny-mixed": _tiny_mixed,
    "tiny-tp": _tiny_tp,
    "tiny-sliding": _tiny_sliding,
    "tiny-largest": _tiny_largest,
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> DeepseekV4Config:
    """A fresh config for preset ``name`` (configs are mutable, so every call builds a new one)."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown tiny preset {name!r}; choose one of {sorted(PRESETS)} (tiny_models.presets.PRESETS)"
        ) from None
    return factory()


def compress_ratio_of(cfg: DeepseekV4Config, layer: int) -> int:
    """The compress ratio m of decoder layer ``layer`` (0 = sliding only); the MTP layer is always 0."""
    if layer >= cfg.num_hidden_layers:
        return 0
    kind = cfg.layer_types[layer]
    return 0 if kind == SLIDING else int(cfg.compress_rates[kind])


def min_seq_len(cfg: DeepseekV4Config) -> int:
    """Shortest test sequence that exercises every layer kind of ``cfg``.

    It exceeds the sliding window twice over, lets HCA emit at least two entries, and gives CSA
    ``2 * index_topk + 1`` compressed entries so the indexer's top-k really selects (top-k < entries
    for the later half of the queries). Rounded up to a multiple of every compress ratio in use.
    """
    kinds = set(cfg.layer_types)
    need, step = 2 * cfg.sliding_window, 1
    if HCA in kinds:
        rate = int(cfg.compress_rates[HCA])
        need, step = max(need, 2 * rate), math.lcm(step, rate)
    if CSA in kinds:
        rate = int(cfg.compress_rates[CSA])
        need, step = max(need, rate * (2 * cfg.index_topk + 1)), math.lcm(step, rate)
    return -(-need // step) * step


def _full_size(**fields: object) -> DeepseekV4Config:
    # Built from the published config.json fields (legacy keys, folded by transformers); no weights.
    return DeepseekV4Config(
        architectures=["DeepseekV4ForCausalLM"],
        dtype="bfloat16",
        num_key_value_heads=1,
        head_dim=512,
        qk_rope_head_dim=64,
        sliding_window=128,
        compress_rope_theta=160000.0,
        rope_theta=10000.0,
        rope_scaling=_yarn(16.0, 65536),
        max_position_embeddings=1048576,
        index_n_heads=64,
        index_head_dim=128,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        n_shared_experts=1,
        num_experts_per_tok=6,
        num_hash_layers=3,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        swiglu_limit=10.0,
        num_nextn_predict_layers=1,
        vocab_size=129280,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        **fields,
    )


def flash_config() -> DeepseekV4Config:
    """DeepSeek-V4-Flash (docs/reference/v4_architecture.md §2.1): 43 layers, ratios [0,0]+[4,128]*20+[4,0]."""
    return _full_size(
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        index_topk=512,
        routed_scaling_factor=1.5,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    )


def pro_config() -> DeepseekV4Config:
    """DeepSeek-V4-Pro (docs/reference/v4_architecture.md §2.1): 61 layers, ratios [128,128]+[4,128]*29+[4,0]."""
    return _full_size(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        n_routed_experts=384,
        moe_intermediate_size=3072,
        index_topk=1024,
        routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    )
