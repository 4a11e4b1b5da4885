"""Wrong: the adapter is a pickled ``adapter_model.bin`` (code runs when it is loaded), as Miles' main once wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from implementations.wrong import HandWrittenExport


class Pickled(HandWrittenExport):
    name = "pickled adapter"

    def write(self, out_dir: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        import torch

        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, out_dir / "adapter_model.bin")
        (out_dir / "adapter_config.json").write_text(json.dumps(config))
        (out_dir / ".complete").write_text("")


DRIVER = Pickled(provenance="implementations/wrong/pickled.py")
