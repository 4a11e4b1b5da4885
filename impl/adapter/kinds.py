"""What any module or tensor name of a DeepSeek-V4 base is, in every naming dialect.

A third-party adapter, such as stock PEFT with suffix ``target_modules`` or ``"all-linear"``, wraps whatever its spec
matches, so to judge it every name must resolve to its :class:`ModuleKind`. :func:`place_module` reads a path in any
dialect; :func:`dialect_module` writes an official module in a dialect. Attention rows come from
:data:`impl.vocabulary.TARGET_TABLE`; the rest follow transformers' own ``deepseek_v4`` checkpoint renaming."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

from impl.adapter.dialects import DIALECTS, resolve_module


class ModuleKind(StrEnum):
    MAIN = "main-attention target"
    INDEXER = "indexer"
    COMPRESSOR = "compressor"
    ROUTED_EXPERT = "routed expert"
    SHARED_EXPERT = "shared expert"
    ROUTER = "router"
    MTP = "MTP"
    EMBEDDING = "embedding"
    HEAD = "head"
    NORM = "norm"
    HYPER_CONNECTION = "hyper-connection"
    SINK = "attention sink"


K = ModuleKind

#: (kind, official module template, transformers module template or None); ``{N}``: layer, ``{E}``: expert.
#: Templates name modules (parameter names are these plus ``.weight`` etc.); the order is the match order.
_RULES: tuple[tuple[ModuleKind, str | None, str | None], ...] = (
    (K.EMBEDDING, "embed", "model.embed_tokens"),
    (K.HEAD, "head", "lm_head"),
    (K.NORM, "norm", "model.norm"),
    (K.HYPER_CONNECTION, "hc_head_fn", "model.hc_head.hc_fn"),
    (K.HYPER_CONNECTION, "hc_head_base", "model.hc_head.hc_base"),
    (K.HYPER_CONNECTION, "hc_head_scale", "model.hc_head.hc_scale"),
    (K.HYPER_CONNECTION, None, "model.hc_head"),
    (K.NORM, "layers.{N}.attn_norm", "model.layers.{N}.input_layernorm"),
    (K.NORM, "layers.{N}.ffn_norm", "model.layers.{N}.post_attention_layernorm"),
    (K.NORM, "layers.{N}.attn.q_norm", "model.layers.{N}.self_attn.q_a_norm"),
    (K.NORM, "layers.{N}.attn.kv_norm", "model.layers.{N}.self_attn.kv_norm"),
    (K.COMPRESSOR, "layers.{N}.attn.compressor.norm", "model.layers.{N}.self_attn.compressor.kv_norm"),
    (K.COMPRESSOR, "layers.{N}.attn.compressor.ape", "model.layers.{N}.self_attn.compressor.position_bias"),
    (K.INDEXER, "layers.{N}.attn.indexer.compressor.norm", "model.layers.{N}.self_attn.compressor.indexer.kv_norm"),
    (
        K.INDEXER,
        "layers.{N}.attn.indexer.compressor.ape",
        "model.layers.{N}.self_attn.compressor.indexer.position_bias",
    ),
    (K.SINK, "layers.{N}.attn.attn_sink", "model.layers.{N}.self_attn.sinks"),
    (K.SHARED_EXPERT, "layers.{N}.ffn.shared_experts.w1", "model.layers.{N}.mlp.shared_experts.gate_proj"),
    (K.SHARED_EXPERT, "layers.{N}.ffn.shared_experts.w2", "model.layers.{N}.mlp.shared_experts.down_proj"),
    (K.SHARED_EXPERT, "layers.{N}.ffn.shared_experts.w3", "model.layers.{N}.mlp.shared_experts.up_proj"),
    # transformers fuses the routed experts into 3-D parameters of one module: no per-expert module there
    (K.ROUTED_EXPERT, "layers.{N}.ffn.experts.{E}.w1", None),
    (K.ROUTED_EXPERT, "layers.{N}.ffn.experts.{E}.w2", None),
    (K.ROUTED_EXPERT, "layers.{N}.ffn.experts.{E}.w3", None),
    (K.ROUTED_EXPERT, None, "model.layers.{N}.mlp.experts"),
    (K.ROUTER, "layers.{N}.ffn.gate", "model.layers.{N}.mlp.gate"),
    (K.HYPER_CONNECTION, "layers.{N}.hc_attn_{P}", "model.layers.{N}.attn_hc.{P}"),
    (K.HYPER_CONNECTION, "layers.{N}.hc_ffn_{P}", "model.layers.{N}.ffn_hc.{P}"),
)
_FIELDS = {"N": "[0-9]+", "E": "[0-9]+", "P": "fn|base|scale"}


@dataclass(frozen=True)
class ModulePlace:
    """A module path read back: its kind, the naming it was written in, and the official module (None: the
    dialect's module stands for no single official weight, e.g. transformers' fused routed experts)."""

    kind: ModuleKind
    dialect: str
    official: str | None

    @property
    def official_weight(self) -> str | None:
        return None if self.official is None else self.official + ".weight"


@cache
def _regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"\{([A-Z])\}", template)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{_FIELDS[p]})" for i, p in enumerate(parts)))


def _fill(template: str, fields: dict[str, str]) -> str:
    return re.sub(r"\{([A-Z])\}", lambda m: fields[m[1]], template)


def _table_place(path: str) -> ModulePlace | None:
    ref = resolve_module(path)
    if ref is None:
        return None
    if ref.row.main:
        kind = K.MAIN
    else:
        kind = K.INDEXER if ref.row.official.startswith("indexer.") else K.COMPRESSOR
    if ref.layer is None and kind is not K.MAIN:
        kind = K.MTP
    return ModulePlace(kind, ref.dialect, ref.official_weight.removesuffix(".weight"))


def place_module(path: str) -> ModulePlace | None:
    """What ``path`` (a module path or a parameter name, relative to the base model, any dialect) is; None when
    it names nothing of a V4 base.

    It reads the ``official`` (checkpoint) or ``transformers`` / ``sglang`` (``model.layers.N.self_attn...``)
    naming and returns the kind (a main-attention target, the indexer, a compressor, a routed or shared expert, the
    router, MTP, the embedding, the head, a norm, a hyper-connection or the attention sink) and the official module
    it stands for. Attention rows resolve through :func:`impl.adapter.dialects.resolve_module`; the rest follow
    transformers' ``transformers/conversion_mapping.py``."""
    for candidate in (path, path.rsplit(".", 1)[0] if "." in path else None):
        if candidate is None:
            continue
        hit = _table_place(candidate) or _rule_place(candidate)
        if hit is not None:
            return hit
    return None


def _rule_place(path: str) -> ModulePlace | None:
    if path.startswith("mtp.") and _regex("mtp.{N}").match(path):
        return ModulePlace(K.MTP, "official", path)
    for kind, official, transformers in _RULES:
        for dialect, template in (("official", official), ("transformers", transformers)):
            m = _regex(template).fullmatch(path) if template else None
            if m is not None:
                return ModulePlace(kind, dialect, _fill(official, m.groupdict()) if official else None)
    return None


def dialect_module(official: str, dialect: str) -> str | None:
    """The module path ``dialect`` gives the official module ``official``; None where its model has none."""
    place = _table_place(official)
    if place is not None:
        ref = resolve_module(official)
        if ref is None or (ref.layer is None and DIALECTS[dialect].mtp_module is None):
            return None
        return DIALECTS[dialect].module_name(ref.layer, ref.row)
    if dialect == "official":
        return official if place_module(official) is not None else None
    for _, off, transformers in _RULES:
        m = _regex(off).fullmatch(official) if off else None
        if m is not None:
            return _fill(transformers, m.groupdict()) if transformers else None
    return None


__all__ = ["ModuleKind", "ModulePlace", "dialect_module", "place_module"]
