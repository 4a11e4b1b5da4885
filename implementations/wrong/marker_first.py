"""Wrong: the success marker is written before the adapter, so a failed write leaves it certifying a partial one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from implementations.wrong import HandWrittenExport


class MarkerFirst(HandWrittenExport):
    name = "marker written first"

    def write(self, out_dir: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / ".complete").write_text("")
        save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out_dir / "adapter_config.json").write_text(json.dumps(config))


DRIVER = MarkerFirst(provenance="implementations/wrong/marker_first.py")
