"""THE LoRA target vocabulary of DeepSeek-V4: one row per LoRA-able attention module, everything that varies by target.

Every consumer derives from :data:`TARGET_TABLE` and takes an optional ``table=``, so a new target is one new row:
the qualifier (:mod:`impl.lora.targets`), the naming dialects (:mod:`impl.adapter.dialects`), the gather,
``verify-adapter``, the recipe, ``qualify`` and the default ``--targets``. Bare names are qualified because V4 nests
modules with the same leaf (``also_nested_as``). No megatron import: exporter ranks and ``verify-adapter`` read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from impl.errors import TargetError

__all__ = [
    "ParallelStyle",
    "TARGET_TABLE",
    "TargetRow",
    "TargetTable",
]

#: The attention module of a native decoder (and MTP) layer; every native path below is relative to it.
ATTENTION_SCOPE = "self_attention"

#: The columns that name a row (accepted by the qualifier, in this order).
NAME_COLUMNS = ("official", "transformers", "native")


class ParallelStyle(Enum):
    """How tensor parallelism splits the base weight of a target (and therefore its LoRA halves)."""

    REPLICATED = "replicated"  # whole weight on every TP rank
    COLUMN = "column"  # output rows split over TP
    ROW = "row"  # input columns split over TP
    GROUPED_COLUMN = "grouped_column"  # output split by whole groups; applied block-diagonally per group


@dataclass(frozen=True)
class TargetRow:
    """One LoRA-able attention module under each of its names.

    Why bare names are qualified: V4's attention owns a main ``wq_b`` and ``wkv`` *and* nested modules with the
    same leaf (the indexer's ``wq_b``; the compressors' ``wkv``). A row records that collision in
    ``also_nested_as``; the qualifier therefore rewrites every vocabulary name to its full path under
    ``self_attention``.
    """

    native: str  # path under ``self_attention`` in the native Megatron graph
    official: str  # path under ``attn`` in the official checkpoint
    transformers: str  # path under ``self_attn`` in transformers' DeepseekV4ForCausalLM
    consumer: str  # module name in a vLLM / SGLang ``target_modules`` list
    parallel: ParallelStyle
    nested: bool  # inside the indexer / a compressor: reached only by its qualified name, never exported
    also_nested_as: tuple[str, ...] = field(default=())  # main rows: native paths of nested modules with this leaf

    @property
    def main(self) -> bool:
        """A main-attention projection: what a bare name means, and what a portable adapter may hold."""
        return not self.nested

    @property
    def grouped(self) -> bool:
        """Block-diagonal forward: PEFT's unmerged dense forward would be wrong for it."""
        return self.parallel is ParallelStyle.GROUPED_COLUMN

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a user may give for this target (official, transformers, native; no repeats)."""
        return tuple(dict.fromkeys(getattr(self, column) for column in NAME_COLUMNS))


@dataclass(frozen=True, eq=False)  # identity equality: consumers cache what they derive from a table
class TargetTable:
    """An ordered, validated set of :class:`TargetRow`; the order is the canonical export order."""

    rows: tuple[TargetRow, ...]

    def __post_init__(self) -> None:
        problems = []
        for column in (*NAME_COLUMNS, "consumer"):
            values = [getattr(r, column) for r in self.rows]
            problems += [f"{column} {v!r} names two rows" for v in dict.fromkeys(values) if values.count(v) > 1]
        claims: dict[str, str] = {}
        for row in self.rows:
            for name in row.names:
                if claims.setdefault(name, row.native) != row.native:
                    problems.append(f"name {name!r} means both {claims[name]!r} and {row.native!r}")
        nested = {r.native for r in self.rows if r.nested}
        for row in self.rows:
            if row.nested and row.also_nested_as:
                problems.append(f"nested row {row.native!r} cannot itself collide with nested modules")
            problems += [
                f"{row.native!r}.also_nested_as names {n!r}, which is not a nested row"
                for n in row.also_nested_as
                if n not in nested
            ]
        if problems:
            raise TargetError("LoRA target table is inconsistent: " + "; ".join(problems))

    def with_rows(self, *rows: TargetRow) -> TargetTable:
        """A new table: these rows appended (this one is unchanged)."""
        return TargetTable((*self.rows, *rows))

    @cached_property
    def main(self) -> tuple[TargetRow, ...]:
        return tuple(r for r in self.rows if r.main)

    @cached_property
    def nested(self) -> tuple[TargetRow, ...]:
        return tuple(r for r in self.rows if r.nested)

    @cached_property
    def main_names(self) -> tuple[str, ...]:
        """The main-attention targets by official name: the default LoRA targets everywhere."""
        return tuple(r.official for r in self.main)

    @cached_property
    def vocabulary(self) -> dict[str, str]:
        """Accepted name -> native path under ``self_attention``."""
        return {name: row.native for row in self.rows for name in row.names}

    def row(self, name: str) -> TargetRow | None:
        """The row any accepted name (official, transformers or native) denotes, or None."""
        return self._by_name.get(name)

    def by_column(self, column: str) -> dict[str, TargetRow]:
        """``column`` value -> row, for one naming column (``native``, ``official``, ``transformers``, ``consumer``)."""
        return self._by_column[column]

    @cached_property
    def _by_name(self) -> dict[str, TargetRow]:
        return {name: row for row in self.rows for name in row.names}

    @cached_property
    def _by_column(self) -> dict[str, dict[str, TargetRow]]:
        return {c: {getattr(r, c): r for r in self.rows} for c in (*NAME_COLUMNS, "consumer")}


_R, _C, _ROW, _G = (
    ParallelStyle.REPLICATED,
    ParallelStyle.COLUMN,
    ParallelStyle.ROW,
    ParallelStyle.GROUPED_COLUMN,
)

#: The table (docs/reference/v4_architecture.md §4.2 and §8.1).
TARGET_TABLE = TargetTable(
    (
        TargetRow("wq_a", "wq_a", "q_a_proj", "wq_a", _R, nested=False),
        TargetRow("wq_b", "wq_b", "q_b_proj", "wq_b", _C, nested=False, also_nested_as=("indexer.linear_wq_b",)),
        TargetRow(
            "wkv",
            "wkv",
            "kv_proj",
            "wkv",
            _R,
            nested=False,
            also_nested_as=("compressor.wkv", "indexer.compressor.wkv"),
        ),
        TargetRow("wo_a", "wo_a", "o_a_proj", "wo_a", _G, nested=False),
        TargetRow("wo_b", "wo_b", "o_b_proj", "wo_b", _ROW, nested=False),
        TargetRow(
            "indexer.linear_wq_b", "indexer.wq_b", "compressor.indexer.q_b_proj", "indexer.wq_b", _R, nested=True
        ),
        TargetRow(
            "indexer.linear_weights_proj",
            "indexer.weights_proj",
            "compressor.indexer.scorer.weights_proj",
            "indexer.weights_proj",
            _R,
            nested=True,
        ),
        TargetRow("compressor.wkv", "compressor.wkv", "compressor.kv_proj", "compressor.wkv", _R, nested=True),
        TargetRow("compressor.wgate", "compressor.wgate", "compressor.gate_proj", "compressor.wgate", _R, nested=True),
        TargetRow(
            "indexer.compressor.wkv",
            "indexer.compressor.wkv",
            "compressor.indexer.kv_proj",
            "indexer.compressor.wkv",
            _R,
            nested=True,
        ),
        TargetRow(
            "indexer.compressor.wgate",
            "indexer.compressor.wgate",
            "compressor.indexer.gate_proj",
            "indexer.compressor.wgate",
            _R,
            nested=True,
        ),
    )
)
