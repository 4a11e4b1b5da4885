"""Wrong: the writer raises on its own and its peers wait for it at a barrier it never reaches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from implementations.wrong import HandWrittenExport


class LonelyRaise(HandWrittenExport):
    name = "a rank that raises without telling its peers"

    def export(self, model: Any, out_dir: Path, timeout_s: float) -> None:
        import torch.distributed as dist

        files = self.adapter_files(model)
        if files is not None:
            self.write(Path(out_dir), *files)
        dist.barrier()


DRIVER = LonelyRaise(provenance="implementations/wrong/lonely_raise.py")
