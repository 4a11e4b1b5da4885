"""Wrong: targets matched by leaf name, so ``wq_b`` also wraps the DSA indexer's ``wq_b`` (and ``wkv`` the
compressors'), as a plain suffix match does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import Layout, LoraSpec
from implementations.wrong import HandWrittenExport


def _leaf_patterns(targets: Sequence[str]) -> list[str]:
    return [f"*{t}" for t in targets]


class IndexerTargets(HandWrittenExport):
    name = "targets matched by leaf name"

    def qualify(self, targets: Sequence[str], config: Any) -> list[str]:
        return super().qualify(_leaf_patterns(targets), config)

    def build(self, base: Path, layout: Layout, lora: LoraSpec | None) -> Any:
        if lora is not None:
            lora = LoraSpec(tuple(_leaf_patterns(lora.targets)), lora.rank, lora.alpha)
        return super().build(base, layout, lora)


DRIVER = IndexerTargets(provenance="implementations/wrong/indexer_targets.py")
