"""Megatron-Bridge's own LoRA (``megatron.bridge.peft.lora.LoRA``) on the native V4 graph, under the suites.

The worked example of docs/implementing.md. ``apply_lora`` hands the user's targets and exclusions to Bridge's
``LoRA`` unchanged and calls it the way Bridge's training loop does (``training=True``); no qualification, no
checks of ours. The native graph it is applied to, the config and the error types the suites name come from the
reference implementation (:data:`BORROWED`): Bridge has no V4 graph of its own for this layout, and its LoRA raises
no typed errors, so the suites' ``pytest.raises(impl.TargetError)`` see whatever Bridge does instead.

Known gaps are ``xfails.txt`` next to this file; the report is docs/conformance/bridge_lora.md
(``scripts/conformance_report.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import impl

#: the one capability this module implements (fixtures/contract/capabilities.py)
CAPABILITIES = frozenset({"lora-construction"})
#: names taken from the reference implementation, not Bridge's: the graph LoRA is applied to and the error types
BORROWED = ("compat_report", "V4Config", "DeepseekV4NativeModel", "TargetError", "MultiLoRAUnsupportedError")


def __getattr__(name: str) -> Any:
    # on first use, as the reference resolves its own names: reading CAPABILITIES imports no megatron
    if name in BORROWED:
        return getattr(impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "megatron-bridge-lora"


@dataclass
class BridgeLoraHandle:
    """What Bridge's ``LoRA`` recorded: the object itself and the parameters it would save."""

    lora: Any
    params_to_save: set[str]


def apply_lora(
    model_chunks: list[Any],
    *,
    targets: list[str],
    exclude: list[str] | None = None,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    lora_A_init_method: str = "xavier",
    lora_B_init_method: str = "zero",
    **options: Any,
) -> BridgeLoraHandle:
    """Bridge's ``LoRA(target_modules=targets, exclude_modules=exclude, dim=rank, alpha=alpha, **options)`` applied
    to each chunk with ``training=True``; an option Bridge's LoRA has no field for is Bridge's own ``TypeError``."""
    impl.compat_report()
    from megatron.bridge.peft.lora import LoRA

    lora = LoRA(
        target_modules=list(targets),
        exclude_modules=list(exclude or []),
        dim=rank,
        alpha=alpha,
        dropout=dropout,
        lora_A_init_method=lora_A_init_method,
        lora_B_init_method=lora_B_init_method,
        **options,
    )
    for chunk in model_chunks:
        lora(chunk, training=True)
    return BridgeLoraHandle(lora, set(lora.params_to_save))
