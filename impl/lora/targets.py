"""LoRA target qualification for the native DeepSeek-V4 graph.

The native attention owns a main ``wq_b`` and ``wkv`` *and* nested modules whose leaves collide with them
(``indexer.linear_wq_b``; ``compressor.wkv`` and ``indexer.compressor.wkv``). Megatron-Bridge's
``ModuleMatcher`` accepts a module when its leaf ``name == pattern`` or when the anchored wildcard
``pattern`` matches its full dotted name, so a bare ``wkv`` would also wrap both compressors. Every name
in :data:`TARGET_VOCABULARY` is therefore rewritten to ``*.self_attention.<native path>``, which reaches
exactly one module per attention block; the nested modules are reached only when named explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from impl.errors import TargetError

__all__ = [
    "MAIN_ATTENTION_TARGETS",
    "NESTED_ATTENTION_TARGETS",
    "TARGET_VOCABULARY",
    "bridge_pattern_matches",
    "matched_modules",
    "qualify_exclusions",
    "qualify_targets",
]

ATTENTION_SCOPE = "self_attention"

# One row per LoRA-able attention module: native path under ``self_attention`` -> every accepted name.
# Official checkpoint names first, then the transformers (``DeepseekV4ForCausalLM``) names, then native ones.
_TABLE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wq_a", ("wq_a", "q_a_proj")),
    ("wq_b", ("wq_b", "q_b_proj")),
    ("wkv", ("wkv", "kv_proj")),
    ("wo_a", ("wo_a", "o_a_proj")),
    ("wo_b", ("wo_b", "o_b_proj")),
    ("indexer.linear_wq_b", ("indexer.wq_b", "compressor.indexer.q_b_proj", "indexer.linear_wq_b")),
    (
        "indexer.linear_weights_proj",
        ("indexer.weights_proj", "compressor.indexer.scorer.weights_proj", "indexer.linear_weights_proj"),
    ),
    ("compressor.wkv", ("compressor.wkv", "compressor.kv_proj")),
    ("compressor.wgate", ("compressor.wgate", "compressor.gate_proj")),
    ("indexer.compressor.wkv", ("indexer.compressor.wkv", "compressor.indexer.kv_proj")),
    ("indexer.compressor.wgate", ("indexer.compressor.wgate", "compressor.indexer.gate_proj")),
)

#: accepted name -> native path under ``self_attention`` (the single vocabulary table).
TARGET_VOCABULARY: dict[str, str] = {alias: native for native, aliases in _TABLE for alias in aliases}
#: the five main-attention projections (official names); bare names always mean these.
MAIN_ATTENTION_TARGETS: tuple[str, ...] = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
#: native paths of the nested (indexer / compressor) modules, reachable only by a qualified name.
NESTED_ATTENTION_TARGETS: tuple[str, ...] = tuple(native for native, _ in _TABLE if "." in native)


def _qualified(native: str) -> str:
    return f"*.{ATTENTION_SCOPE}.{native}"


def bridge_pattern_matches(pattern: str, full_name: str) -> bool:
    """Megatron-Bridge's ``ModuleMatcher.match`` rule for one pattern and one module.

    ``name == pattern`` on the leaf, or ``re.compile("^" + pattern.replace("*", "(.*)") + "$")`` on the full
    name (dots deliberately unescaped, as in ``megatron.bridge.peft.utils.wildcard_match``).
    """
    leaf = full_name.rpartition(".")[2]
    if leaf == pattern:
        return True
    return re.match("^" + pattern.replace("*", "(.*)") + "$", full_name) is not None


def matched_modules(patterns: Iterable[str], module_names: Iterable[str]) -> list[str]:
    """Module names (in the given order) that at least one pattern matches under Bridge's rule."""
    patterns = list(patterns)
    return [name for name in module_names if any(bridge_pattern_matches(p, name) for p in patterns)]


def _valid_names(module_names: Sequence[str]) -> list[str]:
    """Vocabulary names whose qualified pattern reaches at least one module in this model."""
    return [
        alias
        for native, aliases in _TABLE
        if any(bridge_pattern_matches(_qualified(native), n) for n in module_names)
        for alias in aliases
    ]


def _qualify(entries, module_names: Iterable[str] | None, *, kind: str):
    if not entries:
        return entries
    single = isinstance(entries, str)
    raw = [entries] if single else list(entries)
    for entry in raw:
        if not isinstance(entry, str) or not entry:
            raise TargetError(f"LoRA {kind} entries must be non-empty strings; got {entry!r} in {raw!r}")
        if "," in entry:
            raise TargetError(
                f"LoRA {kind} {entry!r} contains a comma; pass a list of names instead of one comma-joined string"
            )
    out = [_qualified(TARGET_VOCABULARY[e]) if e in TARGET_VOCABULARY else e for e in raw]
    if module_names is not None:
        names = list(module_names)
        unmatched = [
            (e, q) for e, q in zip(raw, out, strict=True) if not any(bridge_pattern_matches(q, n) for n in names)
        ]
        if unmatched:
            listed = ", ".join(f"{e!r}" + (f" (as {q!r})" if q != e else "") for e, q in unmatched)
            raise TargetError(
                f"LoRA {kind}(s) {listed} match no module of this model. "
                f"Valid names here: {', '.join(_valid_names(names))}; or pass an anchored wildcard over full "
                f"module names such as '*.layers.0.{ATTENTION_SCOPE}.wq_b'. Fix the {kind} list and retry."
            )
    return out[0] if single else out


def qualify_targets(targets, *, module_names: Iterable[str] | None = None):
    """Rewrite LoRA targets so each vocabulary name reaches exactly its main-attention (or named nested) module.

    ``wq_b``/``q_b_proj`` -> ``*.self_attention.wq_b`` (never the indexer's ``linear_wq_b``); ``indexer.wq_b`` ->
    ``*.self_attention.indexer.linear_wq_b``; anything else (wildcards, dotted paths, other leaves) passes through.
    Order is preserved, the rewrite is idempotent, a ``str`` stays a ``str`` and a falsy value is returned as-is.
    With ``module_names`` every entry must match a module (Bridge's rule), else :class:`TargetError` lists all
    unmatched entries and the valid names.
    """
    return _qualify(targets, module_names, kind="target")


def qualify_exclusions(exclude, *, module_names: Iterable[str] | None = None):
    """:func:`qualify_targets` for ``exclude_modules`` (same vocabulary, same checks)."""
    return _qualify(exclude, module_names, kind="exclusion")
