"""This implementation driven through the conformance contract, like any other: what ``dsv4-lora qualify`` runs.

Glue only: every method is one or two calls of the package's public API. ``DSV4_IMPL`` names the package to drive
(default: the one this module is in), so the mutation check can drive a mutated copy.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import Driver, Layout, LoadReport, LoraSpec


def _api() -> Any:
    return importlib.import_module(os.environ.get("DSV4_IMPL") or __package__)


@dataclass
class _Model:
    chunks: list[Any]
    handle: Any
    report: Any
    base: Path


def _init_parallel(api: Any, layout: Layout) -> None:
    import impl.compat.active  # noqa: F401 - megatron only after the CPU compat layer (suites/meta/test_compat_first.py)

    api.compat_report()  # the driven package's (DSV4_IMPL) layer too
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=layout.collective_timeout_s / 60,
    )
    model_parallel_cuda_manual_seed(1234)


def _hf_config(config: Mapping[str, Any] | Path) -> Any:
    """transformers' ``DeepseekV4Config`` itself, never through ``AutoConfig`` (whose registry another
    implementation driven in the same process may have changed: Miles' ``load_hf_config`` does)."""
    from transformers import DeepseekV4Config

    if isinstance(config, Path):
        config = json.loads((config / "config.json").read_text())
    return DeepseekV4Config.from_dict(dict(config))


def _official(api: Any, native_module: str) -> str:
    """A native module's name in the checkpoint's vocabulary (the mapping table's row for its weight)."""
    hit = api.lookup_native(f"{native_module}.weight")
    return hit[2][0].removesuffix(".weight") if hit else native_module


def _positions(ids: Any) -> Any:
    import torch

    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)


def _on_model(chunk: Any, *tensors: Any) -> tuple[Any, ...]:
    """The contract's CPU tensors on the device the model's weights are on (a GPU host builds on CUDA)."""
    device = next(chunk.parameters()).device
    return tuple(t.to(device) for t in tensors)


def build_graph(
    api: Any, base: Path, layout: Layout, lora_hook: Any = None, *, initialise: bool = True
) -> tuple[list[Any], Any]:
    """The reference's native graph of ``base`` at ``layout`` (strict load, then ``lora_hook`` before DDP): its
    chunks and load report. Other drivers whose own graph cannot be built here apply their LoRA to it
    (``initialise=False``: Megatron's parallel state is already the layout's, set up by the caller)."""
    import torch

    if initialise:
        _init_parallel(api, layout)
    loaded: dict[str, Any] = {}

    def load_base(chunks: list[Any]) -> list[Any]:
        loaded["report"] = api.load_official_checkpoint(chunks, base)
        return chunks

    chunks = api.build_native_model(
        _hf_config(base),
        tp=layout.tp,
        ep=layout.ep,
        pp=layout.pp,
        pre_wrap_hooks=[load_base] + ([lora_hook] if lora_hook is not None else []),
        wrap_with_ddp=True,
        params_dtype=getattr(torch, layout.dtype),
    )
    return chunks, loaded["report"]


class ReferenceDriver(Driver):
    name = "reference"
    capabilities = frozenset({"detection", "targets", "lora", "conversion", "export", "faults", "training_loop"})
    success_marker = ".complete"
    dialects = frozenset({"transformers", "official", "sglang"})

    def warm(self) -> None:
        api = _api()
        api.compat_report()
        for name in ("build_native_model", "load_official_checkpoint", "make_lora_pre_wrap_hook", "export_adapter"):
            getattr(api, name)

    def recognises(self, config: Mapping[str, Any]) -> bool:
        return bool(_api().is_deepseek_v4_config(config))

    def qualify(self, targets: Sequence[str], config: Mapping[str, Any]) -> list[str]:
        import torch

        api = _api()
        _init_parallel(api, Layout())
        with torch.device("meta"):  # the whole graph, no memory: full-size configs too
            model = api.DeepseekV4NativeModel(api.V4Config.from_hf(_hf_config(config)))
            handle = api.apply_lora([model], targets=list(targets), rank=2, alpha=2.0)
        return [_official(api, n) for chunk in handle.wrapped for n in chunk]

    def build(self, base: Path, layout: Layout, lora: LoraSpec | None) -> _Model:
        api = _api()
        hook = None
        if lora is not None:
            hook = api.make_lora_pre_wrap_hook(targets=list(lora.targets), rank=lora.rank, alpha=lora.alpha)
        chunks, report = build_graph(api, base, layout, hook)
        return _Model(chunks, getattr(hook, "handle", None), report, base)

    def load_report(self, model: _Model) -> LoadReport:
        r = model.report
        return LoadReport(len(r.loaded), tuple(r.missing), tuple(r.unmapped))

    def logits(self, model: _Model, input_ids: Any) -> Any:
        import torch

        (chunk,) = model.chunks
        chunk.eval()
        (input_ids,) = _on_model(chunk, input_ids)
        with torch.no_grad():
            return _api().ManualPipeline(chunk).run(input_ids, _positions(input_ids)).float()

    def train_step(self, model: _Model, input_ids: Any, labels: Any, lr: float) -> float:
        import torch

        params = list(self.adapter_parameters(model).values())
        optimizer = torch.optim.SGD(params, lr=lr)
        input_ids, labels = _on_model(model.chunks[0], input_ids, labels)
        return _api().adapter_train_step(
            model.chunks, input_ids, optimizer, labels=labels, position_ids=_positions(input_ids)
        )

    def adapter_parameters(self, model: _Model) -> dict[str, Any]:
        (chunk,) = model.chunks
        return {n: p for n, p in chunk.named_parameters() if p.requires_grad}

    def export(self, model: _Model, out_dir: Path, timeout_s: float, dialect: str = "transformers") -> None:
        api = _api()
        api.export_adapter(
            lambda: api.gather_adapter_state(model.chunks, model.handle),
            out_dir,
            dialect=dialect,
            base_model_name_or_path=str(model.base),
            fingerprint_base=model.base,
            timeout_s=timeout_s,
        )

    def import_adapter(self, model: _Model, adapter_dir: Path) -> None:
        _api().import_adapter(model.chunks, adapter_dir, handle=model.handle, base=model.base)


DRIVER = ReferenceDriver(provenance="this repository's impl/")
