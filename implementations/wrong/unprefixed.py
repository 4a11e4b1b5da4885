"""Wrong: the keys lack PEFT's ``base_model.model.`` prefix, so ``PeftModel.from_pretrained`` loads nothing and the
adapter is a silent no-op (Miles #2580's report of its main)."""

from __future__ import annotations

from typing import Any

from implementations.wrong import HandWrittenExport


class Unprefixed(HandWrittenExport):
    name = "keys without PEFT's prefix"

    def adapter_files(self, model: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        files = super().adapter_files(model)
        if files is None:
            return None
        tensors, config = files
        return {k.removeprefix("base_model.model."): v for k, v in tensors.items()}, config


DRIVER = Unprefixed(provenance="implementations/wrong/unprefixed.py")
