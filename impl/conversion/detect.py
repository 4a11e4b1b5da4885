"""Exact DeepSeek-V4 architecture detection.

Only ``architectures[0] == "DeepseekV4ForCausalLM"`` selects the V4 path. Missing, ``None`` or
empty ``architectures``, DeepSeek-V3 / V3.2 and look-alike names (case variants, prefixes,
suffixes) do not: treating V4 as V3, or V3 as V4, loads a graph with thousands of unmapped tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from impl.errors import NotDeepseekV4Error

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"


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


def require_deepseek_v4_config(config: Any) -> Any:
    """Return ``config`` if it is DeepSeek-V4, else raise :class:`NotDeepseekV4Error` naming what was found."""
    if is_deepseek_v4_config(config):
        return config
    archs = _architectures(config)
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    raise NotDeepseekV4Error(
        f"expected architectures[0] == {V4_ARCHITECTURE!r}, found architectures={archs!r} "
        f"(model_type={model_type!r}); this path builds DeepSeek-V4 only - set architectures in config.json "
        f"or use the generic Megatron-Bridge AutoBridge path for other models"
    )
