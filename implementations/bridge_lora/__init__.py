"""Megatron-Bridge's own LoRA and adapter export, under the conformance suites.

What is Bridge's: the decision whether a config is DeepSeek-V4 (its bridge dispatch picks its own
``DeepSeekV4Bridge``), which modules a target wraps and how (``megatron.bridge.peft.lora.LoRA`` applied as its training
loop does, ``training=True``), and the export (``AutoBridge.save_hf_adapter``, Bridge's adapter streaming and PEFT
writer). What is not: Megatron-Bridge 0.6.2 has no DeepSeek-V4 graph in this layout (its V4 bridge maps Megatron-Core's
hybrid model, on MCore's dev branch), so the graph LoRA is applied to, its loader, forward and train step are the
reference's (``impl``), and the model bridge ``save_hf_adapter`` uses for that graph's names is the reference's too.
Known gaps: ``xfails.txt``; the report: docs/conformance/bridge_lora.md.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import Driver, Layout, LoraSpec
from impl.driver import ReferenceDriver, _api, _hf_config, _init_parallel, _official, build_graph


@dataclass
class _BridgeModel:
    chunks: list[Any]
    lora: Any
    report: Any
    base: Path


def _bridge_lora(lora: LoraSpec) -> Any:
    from megatron.bridge.peft.lora import LoRA

    return LoRA(target_modules=list(lora.targets), dim=lora.rank, alpha=lora.alpha)


def _wrapped(model: Any) -> list[str]:
    """The modules Bridge's LoRA wrapped: each holding an ``adapter`` it added."""
    from megatron.bridge.peft.lora_layers import LoRALinear

    return [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]


class BridgeLoraDriver(Driver):
    name = "Megatron-Bridge's own LoRA"
    capabilities = frozenset({"detection", "targets", "lora", "export", "faults"})

    def warm(self) -> None:
        ReferenceDriver().warm()

    def recognises(self, config: Mapping[str, Any]) -> bool:
        _api().compat_report()
        from megatron.bridge.models.conversion.model_bridge import get_model_bridge

        try:
            bridge = get_model_bridge(list(config.get("architectures") or [])[0])
        except Exception:  # Bridge knows no bridge for it
            return False
        return type(bridge).__name__ == "DeepSeekV4Bridge"

    def qualify(self, targets: Sequence[str], config: Mapping[str, Any]) -> list[str]:
        import torch

        api = _api()
        _init_parallel(api, Layout())
        with torch.device("meta"):
            model = api.DeepseekV4NativeModel(api.V4Config.from_hf(_hf_config(config)))
            _bridge_lora(LoraSpec(tuple(targets), 2, 2.0))([model], training=True)
        return [_official(api, name) for name in _wrapped(model)]

    def build(self, base: Path, layout: Layout, lora: LoraSpec | None) -> _BridgeModel:
        peft = _bridge_lora(lora) if lora is not None else None

        def apply_lora(chunks: list[Any]) -> list[Any]:
            transformed = peft(chunks, training=True)
            peft.set_params_to_save(transformed)
            return transformed

        chunks, report = build_graph(_api(), base, layout, apply_lora if peft is not None else None)
        return _BridgeModel(chunks, peft, report, base)

    def load_report(self, model: _BridgeModel) -> Any:
        return ReferenceDriver().load_report(model)

    def logits(self, model: _BridgeModel, input_ids: Any) -> Any:
        return ReferenceDriver().logits(model, input_ids)

    def train_step(self, model: _BridgeModel, input_ids: Any, labels: Any, lr: float) -> float:
        return ReferenceDriver().train_step(model, input_ids, labels, lr)

    def adapter_parameters(self, model: _BridgeModel) -> dict[str, Any]:
        return ReferenceDriver().adapter_parameters(model)

    def export(self, model: _BridgeModel, out_dir: Path, timeout_s: float) -> None:
        from megatron.bridge import AutoBridge

        api = _api()

        class NativeAutoBridge(AutoBridge):  # Bridge's dispatch, with the reference's model bridge for this graph
            @property
            def _model_bridge(self) -> Any:
                return api.DeepseekV4ConversionBridge()

        bridge = NativeAutoBridge.from_hf_pretrained(str(model.base))
        bridge.save_hf_adapter(
            [c.module for c in model.chunks], out_dir, peft_config=model.lora, base_model_name_or_path=str(model.base)
        )


def _version() -> str:
    try:
        return md.version("megatron-bridge")
    except md.PackageNotFoundError:
        return "absent"


DRIVER = BridgeLoraDriver(provenance=f"megatron-bridge {_version()} from the package index, on the reference's graph")
