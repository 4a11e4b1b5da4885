"""Exact DeepSeek-V4 architecture detection.

Only ``architectures[0] == "DeepseekV4ForCausalLM"`` selects the V4 path. Missing, ``None`` or
empty ``architectures``, DeepSeek-V3 / V3.2 and look-alike names (case variants, prefixes,
suffixes) do not: treating V4 as V3, or V3 as V4, loads a graph with thousands of unmapped tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from impl.errors import DeepseekV41UnsupportedError, NotDeepseekV4Error

__all__ = [
    "V4_ARCHITECTURE",
    "is_deepseek_v41_config",
    "is_deepseek_v4_config",
    "require_deepseek_v4_config",
]

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
#: DeepSeek-V4.1's spellings: the released config, and the earlier ones SGLang's config loader still accepts
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration")
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v4.1")
#: What a user pointing a V4 tool at V4.1 must be told (docs/deepseek_v41.md has the facts and their sources)
V41_REASON = (
    "DeepSeek-V4.1 is a different architecture, not supported yet: a nested text_config + vision_config, 40 layers "
    "at hidden 5120, Engram and DSpark (3 MTP) modules, cross-layer KV sharing, FP8 weights in 32x32 blocks and FP4 "
    "experts, no hash layers and no learned hc_head; the five attention projections keep their names but change "
    "shape, so V4 adapters and mappings do not transfer. Supporting it needs an independent oracle (no "
    "transformers release has a V4.1 model yet) and a mapping table of its own; see docs/deepseek_v41.md"
)


def _architectures(config: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get("architectures")
    return getattr(config, "architectures", None)


def is_deepseek_v4_config(config: Any) -> bool:
    """True iff the config's first architecture is exactly ``DeepseekV4ForCausalLM``."""
    archs = _architectures(config)
    if isinstance(archs, str) or not archs:
        return False
    try:
        first = archs[0]
    except (TypeError, IndexError, KeyError):
        return False
    return isinstance(first, str) and first == V4_ARCHITECTURE


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def is_deepseek_v41_config(config: Any) -> bool:
    """True when the config (or its nested ``text_config``) names DeepSeek-V4.1 in any known spelling."""
    for cfg in (config, _field(config, "text_config")):
        if cfg is None:
            continue
        archs = _architectures(cfg)
        first = archs[0] if isinstance(archs, list | tuple) and archs else None
        if first in V41_ARCHITECTURES or _field(cfg, "model_type") in V41_MODEL_TYPES:
            return True
    return False


def v41_problem(config: Any) -> str:
    """One line: what was found, and why it is not supported."""
    return f"architectures={_architectures(config)!r}, model_type={_field(config, 'model_type')!r}: {V41_REASON}"


def require_deepseek_v4_config(config: Any) -> Any:
    """Return ``config`` if it is DeepSeek-V4, else raise :class:`NotDeepseekV4Error` naming what was found
    (:class:`DeepseekV41UnsupportedError`, saying why, for DeepSeek-V4.1)."""
    if is_deepseek_v4_config(config):
        return config
    if is_deepseek_v41_config(config):
        raise DeepseekV41UnsupportedError(v41_problem(config))
    archs = _architectures(config)
    model_type = _field(config, "model_type")
    raise NotDeepseekV4Error(
        f"expected architectures[0] == {V4_ARCHITECTURE!r}, found architectures={archs!r} "
        f"(model_type={model_type!r}); this path builds DeepSeek-V4 only - set architectures in config.json "
        f"or use the generic Megatron-Bridge AutoBridge path for other models"
    )
