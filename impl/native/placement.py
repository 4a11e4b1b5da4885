"""Device placement: where this rank's tensors must live, and an audit that names every tensor living elsewhere.

On a CUDA host every parameter, buffer, DDP gradient / parameter buffer, ``main_grad``, optimizer state and input of a
rank lives on ``cuda:LOCAL_RANK``, the device torchrun's ranks select; on a CPU host on the CPU. A misplaced tensor is
not always an error at once (gloo accepts CPU tensors, ``copy_`` crosses devices), so :func:`audit_devices` lists each
one and :func:`require_devices` raises :class:`DevicePlacementError` with that list."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from impl.errors import DevicePlacementError

__all__ = [
    "Misplaced",
    "audit_devices",
    "rank_device",
    "require_devices",
]


@dataclass(frozen=True)
class Misplaced:
    kind: str  # parameter | buffer | main_grad | ddp grad_data | ddp param_data | optimizer state | input
    name: str
    device: torch.device

    def __str__(self) -> str:
        return f"{self.kind} {self.name} on {self.device}"


def rank_device() -> torch.device:
    """This rank's device: the current CUDA device (``cuda:LOCAL_RANK`` under torchrun) if CUDA exists, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _unwrap(chunk: nn.Module) -> nn.Module:
    while isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    return chunk


def _chunk_tensors(c: int, chunk: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    model = _unwrap(chunk)
    for name, p in model.named_parameters():
        yield "parameter", f"chunk {c} {name}", p
        main_grad = getattr(p, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            yield "main_grad", f"chunk {c} {name}", main_grad
    for name, b in model.named_buffers():
        yield "buffer", f"chunk {c} {name}", b
    for attr in ("buffers", "expert_parallel_buffers"):  # Megatron DDP's contiguous param / grad buffers
        held = getattr(chunk, attr, None)
        if chunk is model or not isinstance(held, list | tuple):
            continue
        for i, buf in enumerate(held):
            for field in ("grad_data", "param_data"):
                t = getattr(buf, field, None)
                if isinstance(t, torch.Tensor):
                    yield f"ddp {field}", f"chunk {c} {attr}[{i}]", t


def _optimizer_tensors(opt: Any, names: Mapping[int, str], path: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """torch optimizers (``state``), Megatron's wrappers (``optimizer``, fp32 master groups) and chained ones."""
    for i, inner in enumerate(getattr(opt, "chained_optimizers", None) or ()):
        yield from _optimizer_tensors(inner, names, f"{path}.chained[{i}]")
    inner = getattr(opt, "optimizer", None)
    if inner is not None and inner is not opt:
        yield from _optimizer_tensors(inner, names, path)
    for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "fp32_from_fp32_groups"):
        for g, group in enumerate(getattr(opt, attr, None) or ()):
            for j, t in enumerate(group):
                if isinstance(t, torch.Tensor):
                    yield "optimizer state", f"{path}.{attr}[{g}][{j}]", t
    state = getattr(opt, "state", None)
    if isinstance(state, Mapping):
        for param, entries in state.items():
            label = names.get(id(param), f"param#{id(param):x}")
            for key, t in (entries or {}).items() if isinstance(entries, Mapping) else ():
                if isinstance(t, torch.Tensor) and t.dim() > 0:  # Adam's scalar step may stay on the CPU
                    yield "optimizer state", f"{path}[{label}].{key}", t


def audit_devices(
    model_chunks: nn.Module | Iterable[nn.Module],
    optimizer: Any = None,
    *,
    expected: torch.device | str | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> list[Misplaced]:
    """Every tensor of this rank that is not on ``expected`` (default :func:`rank_device`), in walk order.

    Walks each chunk's parameters (and their ``main_grad``), buffers, Megatron DDP grad / param buffers, the
    optimizer's state and fp32 master copies (torch, Megatron and chained optimizers), and the named ``inputs``.
    """
    want = _normalize(expected if expected is not None else rank_device())
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    names = {id(p): f"chunk {c} {n}" for c, ch in enumerate(chunks) for n, p in _unwrap(ch).named_parameters()}
    found: list[tuple[str, str, torch.Tensor]] = []
    for c, chunk in enumerate(chunks):
        found += _chunk_tensors(c, chunk)
    if optimizer is not None:
        found += _optimizer_tensors(optimizer, names, "optimizer")
    found += [("input", name, t) for name, t in (inputs or {}).items()]
    return [Misplaced(kind, name, t.device) for kind, name, t in found if t.device != want]


def require_devices(
    model_chunks: nn.Module | Iterable[nn.Module],
    optimizer: Any = None,
    *,
    expected: torch.device | str | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """:func:`audit_devices`, raising :class:`DevicePlacementError` that names every misplaced tensor."""
    want = _normalize(expected if expected is not None else rank_device())
    bad = audit_devices(model_chunks, optimizer, expected=want, inputs=inputs)
    if bad:
        raise DevicePlacementError(
            f"{len(bad)} tensors are not on {want}: "
            + "; ".join(map(str, bad[:40]))
            + (f"; ... {len(bad) - 40} more" if len(bad) > 40 else "")
            + ". Build through impl.build_native_model on a CUDA host (it places every chunk on the current "
            "device) and create inputs on impl.rank_device()."
        )
