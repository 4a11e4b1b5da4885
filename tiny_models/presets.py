"""Named tiny DeepSeek-V4 configs, plus the full-size Flash / Pro configs (no weights allocated).

Together the tiny presets cover every V4 feature: sliding-only layers, CSA (ratio 4: overlapping
compressor + lightning indexer), HCA (ratio 8 / 16 / 32 via explicit ``layer_types`` + ``compress_rates``,
because transformers maps only the legacy ratios 0/4/128), hash-routed and score-routed MoE (expert bias),
a shared expert, ``o_groups >= 2``, ``hc_mult >= 2``, one MTP layer and YaRN on compressed layers.

The configs' field values are data, in ``presets.toml`` beside this module (one table per preset, the
quantization config of :mod:`tiny_models.quantize` and the full-size configs); this module checks each table's
keys and builds the configs, deriving what follows from the fields (:func:`tiny_config`).
"""

from __future__ import annotations

import copy
import math
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path

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
    "tiny_fields",
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


PRESETS_FILE = Path(__file__).with_name("presets.toml")
# The keys each table of presets.toml takes. A tiny table states tiny_config's schedule and every shape fact
# (transformers' defaults are Flash's, never tiny); only the optional ones may fall back to a default.
_TINY_OPTIONAL = frozenset("hca_rate yarn_factor yarn_original routed_scaling_factor swiglu_limit".split())
_TINY_KEYS = _TINY_OPTIONAL | frozenset(
    "layer_types num_hash_layers vocab_size hidden_size num_attention_heads head_dim qk_rope_head_dim q_lora_rank "
    "o_groups o_lora_rank sliding_window n_routed_experts num_experts_per_tok moe_intermediate_size n_shared_experts "
    "index_n_heads index_head_dim index_topk hc_mult hc_sinkhorn_iters num_nextn_predict_layers".split()
)
_FULL_SIZE_SHARED_KEYS = frozenset(
    "dtype num_key_value_heads head_dim qk_rope_head_dim sliding_window compress_rope_theta rope_theta yarn_factor "
    "yarn_original max_position_embeddings index_n_heads index_head_dim hc_mult hc_sinkhorn_iters hc_eps "
    "n_shared_experts num_experts_per_tok num_hash_layers scoring_func norm_topk_prob swiglu_limit "
    "num_nextn_predict_layers vocab_size rms_norm_eps hidden_act tie_word_embeddings bos_token_id eos_token_id".split()
)
_FULL_SIZE_MODEL_KEYS = frozenset(
    "hidden_size num_hidden_layers num_attention_heads q_lora_rank o_groups o_lora_rank n_routed_experts "
    "moe_intermediate_size index_topk routed_scaling_factor compress_ratios".split()
)


def _checked(entry: dict, where: str, keys: frozenset[str], optional: frozenset[str] = frozenset()) -> dict:
    unknown, missing = sorted(set(entry) - keys), sorted(keys - optional - set(entry))
    if unknown or missing:
        raise ValueError(f"{PRESETS_FILE.name}: {where}: unknown keys {unknown}, missing keys {missing}")
    return entry


def _load() -> dict[str, dict]:
    data = _checked(tomllib.loads(PRESETS_FILE.read_text()), "top level", frozenset({"preset", "quant", "full_size"}))
    for name, entry in data["preset"].items():
        _checked(entry, f"[preset.{name!r}]", _TINY_KEYS, _TINY_OPTIONAL)
    _checked(data["quant"], "[quant]", _TINY_KEYS, _TINY_OPTIONAL)
    full = _checked(data["full_size"], "[full_size]", frozenset({"shared", "flash", "pro"}))
    _checked(full["shared"], "[full_size.shared]", _FULL_SIZE_SHARED_KEYS)
    for model in ("flash", "pro"):
        _checked(full[model], f"[full_size.{model}]", _FULL_SIZE_MODEL_KEYS)
    return data


_TABLES = _load()


def tiny_fields(name: str) -> dict[str, object]:
    """``tiny_config``'s keywords for tiny table ``name`` of presets.toml (a preset, or ``"quant"``), a fresh copy."""
    return copy.deepcopy(_TABLES["quant"] if name == "quant" else _TABLES["preset"][name])


def _tiny_preset(name: str) -> DeepseekV4Config:
    return tiny_config(**tiny_fields(name))


PRESETS: dict[str, Callable[[], DeepseekV4Config]] = {name: partial(_tiny_preset, name) for name in _TABLES["preset"]}


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


def _full_size(model: str) -> DeepseekV4Config:
    """The published config.json fields of ``model`` (legacy keys, folded by transformers); no weights."""
    full = _TABLES["full_size"]
    fields = copy.deepcopy({**full["shared"], **full[model]})
    rope_scaling = _yarn(fields.pop("yarn_factor"), fields.pop("yarn_original"))
    return DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"], rope_scaling=rope_scaling, **fields)


def flash_config() -> DeepseekV4Config:
    """DeepSeek-V4-Flash (docs/reference/v4_architecture.md §2.1): 43 layers, ratios [0,0]+[4,128]*20+[4,0]."""
    return _full_size("flash")


def pro_config() -> DeepseekV4Config:
    """DeepSeek-V4-Pro (docs/reference/v4_architecture.md §2.1): 61 layers, ratios [128,128]+[4,128]*29+[4,0]."""
    return _full_size("pro")
