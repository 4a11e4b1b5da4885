"""Full adapter tensors into a TP / EP / PP-sharded native graph: the inverse of :mod:`impl.adapter.gather`.

Each rank takes its slice of each full tensor along the parameter's own ``partition_dim``; replicated parameters and
data-parallel replicas take the whole tensor, and a stage only the layers it owns, so a tensor saved at one layout
loads at any other. :func:`scatter_problems` is the strict, collective check; :func:`load_full` assumes it passed, so
ranks can agree on the problems before any parameter changes."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from impl.adapter.gather import adapter_parameters

__all__ = ["load_full", "model_adapter_names", "scatter_problems", "shard_of"]


def _tp(param: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """(partition dim, TP size, TP rank) of ``param``; size 1 when it is not split."""
    size = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return 0, 1, 0
    return int(getattr(param, "partition_dim", 0)), size, dist.get_rank(group)


def shard_of(full: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (a view); ValueError when the shapes do not fit."""
    dim, size, rank = _tp(param, group)
    want = list(param.shape)
    want[dim] *= size
    if list(full.shape) != want:
        raise ValueError(f"full shape {list(full.shape)}, this model needs {want}")
    return full if size == 1 else full.narrow(dim, rank * param.shape[dim], param.shape[dim])


def model_adapter_names(chunks: Sequence[nn.Module]) -> set[str]:
    """Every LoRA parameter name of the whole model (collective over the world: each rank holds a part)."""
    local = sorted({name for name, _, _ in adapter_parameters(chunks)})
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return set(local)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return {n for names in everyone for n in names}


def _listed(names: list[str], why: str, most: int = 4) -> list[str]:
    shown = [f"{n}: {why}" for n in names[:most]]
    return shown + ([f"... and {len(names) - most} more such"] if len(names) > most else [])


def scatter_problems(chunks: Sequence[nn.Module], full: Mapping[str, torch.Tensor], names: set[str]) -> list[str]:
    """What stops ``full`` loading into this rank's parameters (``names``: :func:`model_adapter_names`): adapter
    parameters it lacks, tensors the model has no parameter for, shapes that do not fit this layout."""
    problems = _listed(sorted(names - set(full)), "the model has this LoRA parameter, the tensors do not")
    problems += _listed(sorted(set(full) - names), "no LoRA parameter of the model has this name")
    for name, param, group in adapter_parameters(chunks):
        if name in full:
            try:
                shard_of(full[name], param, group)
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
    return problems


def load_full(
    chunks: Sequence[nn.Module],
    full: Mapping[str, torch.Tensor],
    into: Callable[[nn.Parameter], torch.Tensor] | None = None,
) -> int:
    """Copy this rank's slice of every tensor of ``full`` into its parameter (or into ``into(param)``, a tensor
    laid out like it: an fp32 master, an optimizer moment); returns how many were copied. The dtype is the
    target's. Check :func:`scatter_problems` first."""
    count = 0
    with torch.no_grad():
        for name, param, group in adapter_parameters(chunks):
            target = param if into is None else into(param)
            target.copy_(shard_of(full[name], param, group))
            count += 1
    return count
