"""A published PEFT adapter, any dialect and any producer, into the native graph at any layout: the reverse of the
export. The directory is checked as ``verify-adapter`` checks it, each module path is read back to its target
through the one dialect table, and the full tensors load strictly into every rank's slices
(:mod:`impl.adapter.scatter`). The model's LoRA must scale as the adapter does: tensors are copied, never rescaled,
so native -> PEFT -> native is bit-exact. Details: :func:`read_published_adapter`."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)
from impl.errors import AdapterImportError

# isort: split

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from impl.adapter.build import AdapterState
from impl.adapter.dialects import PEFT_PREFIX, native_name, resolve_module
from impl.adapter.exchange import StatusExchange
from impl.adapter.files import ADAPTER_FILE
from impl.adapter.scatter import load_full, model_adapter_names, scatter_problems
from impl.adapter.validation import lora_scale, validate_adapter_dir

__all__ = [
    "import_adapter",
    "read_published_adapter",
]

_HALF = {"lora_A": "A", "lora_B": "B"}


def read_published_adapter(adapter_dir: str | os.PathLike, *, base: Any = None) -> AdapterState:
    """The adapter in ``adapter_dir`` as a full native :class:`AdapterState`, checked first.

    The directory is checked as ``verify-adapter`` checks it (:func:`impl.validate_adapter_dir`: names, halves,
    shapes, finiteness; its base fingerprint against ``base`` when given), and each PEFT module path is read back to
    its target through the one dialect table (:func:`impl.adapter.dialects.resolve_module`) and named as the native
    parameter. The model's LoRA must scale as the adapter does (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
    """
    path = Path(adapter_dir)
    # any producer's adapter: a marker and a fingerprint are checked when present, not required
    checked = validate_adapter_dir(path, base=base, require_complete=False, require_certified=False)
    config = checked["config"]
    tensors: dict[str, torch.Tensor] = {}
    for key, t in load_file(str(path / ADAPTER_FILE)).items():
        module, _, rest = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        half = _HALF.get("lora_" + rest.removesuffix(".weight"))
        ref = resolve_module(module) if half else None
        if ref is None:
            raise AdapterImportError(f"{path / ADAPTER_FILE}: {key} names no DeepSeek-V4 LoRA target")
        tensors[native_name(ref.layer, ref.row, half)] = t
    r = int(config["r"])
    alpha = lora_scale(config) * r  # the scale, as the native graph applies it (alpha / r)
    return AdapterState(tensors, r=r, alpha=alpha, dropout=float(config.get("lora_dropout", 0.0)))


def _scale_problems(path: Path, state: AdapterState, handle: Any) -> list[str]:
    if handle is None:
        return []
    lora = getattr(handle, "lora", handle)
    ours, theirs = float(lora.alpha) / int(lora.dim), state.alpha / state.r
    if ours != theirs:
        return [f"{path}: the adapter scales B@A by {theirs:g}, this model's LoRA by {ours:g} (alpha/r); build the "
                f"model's LoRA with rank {state.r} and alpha {state.alpha:g}"]  # fmt: skip
    return []


def import_adapter(
    model_chunks: Sequence[nn.Module],
    adapter_dir: str | os.PathLike,
    *,
    handle: Any = None,
    base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    timeout_s: float = 300.0,
) -> AdapterState:
    """Collective: load the published adapter in ``adapter_dir`` into this model's LoRA parameters (every rank its
    slice); returns the full state read. ``handle``: the model's LoRA handle (its scale must be the adapter's).
    Every rank checks first and the ranks agree: any problem anywhere raises the same :class:`AdapterImportError`
    on every rank, naming it, and no parameter changes."""
    path = Path(os.path.abspath(adapter_dir))
    ex = StatusExchange(timeout_s, topic="dsv4_import")
    chunks = list(model_chunks)
    names = model_adapter_names(chunks)  # collective: before anything that may fail on one rank only

    def check() -> AdapterState:
        state = read_published_adapter(path, base=base)
        problems = _scale_problems(path, state, handle)
        problems += [f"{path / ADAPTER_FILE}: {p}" for p in scatter_problems(chunks, state.tensors, names)]
        if problems:
            raise AdapterImportError("; ".join(problems))
        return state

    state = ex.run(
        "check",
        check,
        lambda failures: AdapterImportError(f"import of {path} refused: {failures}. No parameter was changed."),
    )
    load_full(chunks, state.tensors)
    return state
