"""LoRA target qualification for the native DeepSeek-V4 graph.

Nested attention modules share leaves with the main ``wq_b`` and ``wkv`` (a row's ``also_nested_as`` in
:mod:`impl.vocabulary`), and Megatron-Bridge's ``ModuleMatcher`` would wrap them too for a bare name. So every name of
the target table is rewritten to ``*.self_attention.<native path>``, which reaches exactly one module per attention
block; nested modules are reached only when named explicitly (:func:`qualify_targets`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from impl.errors import TargetError
from impl.vocabulary import ATTENTION_SCOPE, TARGET_TABLE, TargetTable

__all__ = [
    "MAIN_ATTENTION_TARGETS",
    "NESTED_ATTENTION_TARGETS",
    "TARGET_VOCABULARY",
    "qualify_exclusions",
    "qualify_targets",
]

#: accepted name -> native path under ``self_attention`` (views of :data:`impl.vocabulary.TARGET_TABLE`).
TARGET_VOCABULARY: dict[str, str] = TARGET_TABLE.vocabulary
#: the main-attention projections (official names); bare names always mean these.
MAIN_ATTENTION_TARGETS: tuple[str, ...] = TARGET_TABLE.main_names
#: native paths of the nested (indexer / compressor) modules, reachable only by a qualified name.
NESTED_ATTENTION_TARGETS: tuple[str, ...] = tuple(row.native for row in TARGET_TABLE.nested)


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


def _valid_names(module_names: Sequence[str], table: TargetTable) -> list[str]:
    """Vocabulary names whose qualified pattern reaches at least one module in this model."""
    return [
        name
        for row in table.rows
        if any(bridge_pattern_matches(_qualified(row.native), n) for n in module_names)
        for name in row.names
    ]


def _qualify(entries, module_names: Iterable[str] | None, table: TargetTable, *, kind: str):
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
    vocabulary = table.vocabulary
    out = [_qualified(vocabulary[e]) if e in vocabulary else e for e in raw]
    if module_names is not None:
        names = list(module_names)
        unmatched = [
            (e, q) for e, q in zip(raw, out, strict=True) if not any(bridge_pattern_matches(q, n) for n in names)
        ]
        if unmatched:
            listed = ", ".join(f"{e!r}" + (f" (as {q!r})" if q != e else "") for e, q in unmatched)
            example = table.main[0].native if table.main else "<leaf>"
            raise TargetError(
                f"LoRA {kind}(s) {listed} match no module of this model. "
                f"Valid names here: {', '.join(_valid_names(names, table))}; or pass an anchored wildcard over full "
                f"module names such as '*.layers.0.{ATTENTION_SCOPE}.{example}'. Fix the {kind} list and retry."
            )
    return out[0] if single else out


def qualify_targets(targets, *, module_names: Iterable[str] | None = None, table: TargetTable = TARGET_TABLE):
    """Rewrite LoRA targets so each vocabulary name reaches exactly its main-attention (or named nested) module.

    ``wq_b``/``q_b_proj`` -> ``*.self_attention.wq_b`` (never the indexer's ``linear_wq_b``); ``indexer.wq_b`` ->
    ``*.self_attention.indexer.linear_wq_b``; anything else (wildcards, dotted paths, other leaves) passes through.
    Order is preserved, the rewrite is idempotent, a ``str`` stays a ``str`` and a falsy value is returned as-is.
    With ``module_names`` every entry must match a module (Bridge's rule), else :class:`TargetError` lists all
    unmatched entries and the valid names. ``table``: the target vocabulary (default :data:`TARGET_TABLE`).

    Why: the native attention owns a main ``wq_b`` and ``wkv`` *and* nested modules whose leaves collide with them
    (``indexer.linear_wq_b``; ``compressor.wkv`` and ``indexer.compressor.wkv``). Megatron-Bridge's
    ``ModuleMatcher`` accepts a module when its leaf ``name == pattern`` or when the anchored wildcard ``pattern``
    matches its full dotted name (:func:`bridge_pattern_matches`), so a bare ``wkv`` would also wrap both
    compressors.
    """
    return _qualify(targets, module_names, table, kind="target")


def qualify_exclusions(exclude, *, module_names: Iterable[str] | None = None, table: TargetTable = TARGET_TABLE):
    """:func:`qualify_targets` for ``exclude_modules`` (same vocabulary, same checks)."""
    return _qualify(exclude, module_names, table, kind="exclusion")
