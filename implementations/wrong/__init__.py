"""Deliberately wrong implementations, each one mistake the field has made, for the suites to find.

Each module here is a driver: the reference's model and training, with an export written the way a hurried
implementation writes it (:class:`HandWrittenExport`: gather, then rank 0 writes straight into the destination, then
the ranks compare notes) and one mistake on top. Their reports (docs/conformance/wrong_*.md) show which suite
catches each, and how it names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from impl.driver import ReferenceDriver, _api


class HandWrittenExport(ReferenceDriver):
    """The reference's model, exported without the reference's exporter: no staging, no rename, no recovery."""

    name = "hand-written export"
    capabilities = frozenset({"targets", "lora", "export", "faults"})
    success_marker = ".complete"

    def adapter_files(self, model: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(PEFT tensors, adapter_config.json) on rank 0 (None elsewhere): the reference's gather and naming."""
        api = _api()
        state = api.gather_adapter_state(model.chunks, model.handle)
        return None if state is None else api.publish_in_memory(state)

    def write(self, out_dir: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out_dir / "adapter_config.json").write_text(json.dumps(config))
        (out_dir / ".complete").write_text("")

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether the writer failed, and raises if it did."""
        import torch.distributed as dist

        statuses: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(statuses, "" if error is None else f"{type(error).__name__}: {error}")
        failed = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
        if failed:
            raise RuntimeError("export failed: " + "; ".join(failed)) from error

    def export(self, model: Any, out_dir: Path, timeout_s: float) -> None:
        error = None
        try:
            files = self.adapter_files(model)
            if files is not None:
                self.write(Path(out_dir), *files)
        except Exception as exc:  # reported to every rank by agree()
            error = exc
        self.agree(error)
