"""Coverage of a checkpoint (dir) or manifest by :data:`impl.conversion.mapping.MAPPING_TABLE`.

Per tensor: the native name (in the Miles or the upstream Megatron-Core layout) and semantics it maps to. Totals: mapped, declared-not-loaded (``.scale``
companions consumed by dequantization of their ``.weight``), unmapped (no row), missing (a row's partner or a
family member the present names imply: gated ``w1`` without ``w3``, an expert weight absent in one layer...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from impl.conversion.headers import read_file_header
from impl.conversion.layouts import DESCRIPTION, SAVED_BY_TRANSFORMERS, BaseLayout, read_as_official
from impl.conversion.mapping import (
    fill,
    lookup_native,
    lookup_official,
    native_layout,
    normalize,
    scale_base,
)
from impl.conversion.mapping_table import expected_official_names

__all__ = [
    "CoverageReport",
    "coverage_report",
]


class CoverageEntry(NamedTuple):
    official: str
    status: str  # "mapped" | "declared" | "unmapped"
    native: str | None = None
    semantics: str | None = None
    group: str | None = None
    reason: str = ""


@dataclass
class CoverageReport:
    entries: list[CoverageEntry] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    layout: str = "miles"  # the native layout the ``native`` column names (impl.conversion.mapping.NATIVE_LAYOUTS)
    base_layout: BaseLayout = BaseLayout.OFFICIAL  # the naming the checkpoint's files use (names are official)
    absent_by_layout: list[str] = field(default_factory=list)  # official names that layout never holds (MTP)

    def _count(self, status: str) -> int:
        return sum(1 for e in self.entries if e.status == status)

    @property
    def totals(self) -> dict[str, int]:
        return {
            "mapped": self._count("mapped"),
            "declared_not_loaded": self._count("declared"),
            "unmapped": self._count("unmapped"),
            "missing": len(self.missing),
        }

    @property
    def unmapped(self) -> list[str]:
        return [e.official for e in self.entries if e.status == "unmapped"]

    def table(self, limit: int | None = None) -> str:
        """A printable table: one line per tensor (first ``limit``), then missing names and totals."""
        rows = self.entries if limit is None else self.entries[:limit]
        w = max((len(e.official) for e in rows), default=8)
        lines = [f"{'official':<{w}}  {'status':<8}  {'semantics':<16}  native ({self.layout}) / reason"]
        for e in rows:
            lines.append(f"{e.official:<{w}}  {e.status:<8}  {e.semantics or '-':<16}  {e.native or e.reason}")
        if limit is not None and len(self.entries) > limit:
            lines.append(f"... {len(self.entries) - limit} more")
        lines += [f"{m:<{w}}  missing" for m in self.missing]
        if self.base_layout is not BaseLayout.OFFICIAL:
            lines.append(f"stored in {DESCRIPTION[self.base_layout]}; names above are official")
        if self.absent_by_layout:
            lines.append(f"MTP absent: {len(self.absent_by_layout)} tensor(s) that layout never holds (not counted)")
        lines.append("totals: " + ", ".join(f"{k}={v}" for k, v in self.totals.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table(limit=40)


def _names_of(source: Any) -> tuple[list[str], BaseLayout]:
    """The official names of ``source``'s tensors and the layout they were stored in."""
    if isinstance(source, str | Path):  # headers only (CorruptCheckpointError names a bad file)
        names = [name for f in sorted(Path(source).glob("*.safetensors")) for name, _ in read_file_header(f)]
        layout, official, unknown = read_as_official(names)
        return (names if layout is BaseLayout.OFFICIAL else [*official, *unknown]), layout  # a name twice stays so
    if isinstance(source, Mapping):
        return list(source), BaseLayout.OFFICIAL
    return [n if isinstance(n, str) else n.name for n in source], BaseLayout.OFFICIAL  # names or TensorSpec-like rows


def _implied_missing(names: set[str]) -> list[str]:
    """Names the present ones imply: gated partners, per-layer families, the same expert set in every layer."""
    missing: set[str] = set()
    experts: dict[str, set[str]] = {}
    for n in names:
        hit = lookup_official(n)
        if hit is None:
            continue
        _, row, native, _ = hit
        _, _, officials = lookup_native(native)
        missing.update(o for o in officials if o not in names)
        if row.group == "expert":
            layer, _, rest = n.partition(".ffn.experts.")
            experts.setdefault(layer, set()).add(rest.split(".", 1)[0])
    all_experts = set().union(*experts.values()) if experts else set()
    for layer in experts:
        for e in sorted(all_experts):
            missing.update(n for w in ("w1", "w2", "w3") if (n := f"{layer}.ffn.experts.{e}.{w}.weight") not in names)
    return sorted(missing)


def coverage_report(
    names_or_manifest: Iterable[Any] | Mapping[str, Any] | str | Path, *, config: Any = None, layout: str = "miles"
) -> CoverageReport:
    """Map every tensor name of a checkpoint dir / manifest / name list through the table.

    ``layout`` picks the native naming reported: ``"miles"`` (the graph :mod:`impl.native` builds) or
    ``"upstream"`` (upstream Megatron-Core's ``dsv4_hybrid``, Megatron-Bridge's DeepSeekV4Bridge names).

    With ``config`` (V4Config, transformers config or ``config.json`` dict; read from the dir's ``config.json``
    when given a dir), "missing" is exact: every name :func:`impl.conversion.mapping_table.expected_official_names` implies.
    """
    names, stored = _names_of(names_or_manifest)
    present = set(names)
    if config is None and isinstance(names_or_manifest, str | Path):
        cfg_file = Path(names_or_manifest) / "config.json"
        if cfg_file.exists():
            import json

            config = json.loads(cfg_file.read_text())
    resolve = native_layout(layout).lookup_official
    report = CoverageReport(layout=layout, base_layout=stored)
    for n in names:
        hit = resolve(n)
        if hit is not None:
            _, row, native, _ = hit
            parts = row.layout_names(layout)
            if len(parts) > 1:  # one official tensor split over several parameters (upstream hyper-connection alphas)
                native = " + ".join(fill(p, normalize(n)[1]) for p in parts)
            report.entries.append(CoverageEntry(n, "mapped", native, row.semantics, row.group))
            continue
        base = scale_base(n)
        if base is not None and base in present and lookup_official(base) is not None:
            report.entries.append(CoverageEntry(n, "declared", reason=f"block scale of {base} (dequantized on load)"))
            continue
        report.entries.append(CoverageEntry(n, "unmapped", reason="no row in impl.conversion.mapping"))
    if config is not None:
        report.missing = [n for n in expected_official_names(config) if n not in present]
    else:
        report.missing = _implied_missing(present)
    if stored in SAVED_BY_TRANSFORMERS:  # transformers' model has no MTP: its absence is the layout, not a hole
        report.absent_by_layout = [n for n in report.missing if n.startswith("mtp.")]
        report.missing = [n for n in report.missing if not n.startswith("mtp.")]
    return report
