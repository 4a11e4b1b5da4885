"""Gather a DeepSeek-V4 LoRA adapter from TP / EP / PP-sharded native chunks into one full :class:`AdapterState`.

The gathers are explicit and driven by each adapter parameter's own Megatron attributes. Megatron-Bridge's
``stream_adapter_weights_megatron_to_hf`` is not used because its adapter export does not fit this graph; the
reasons are in :func:`gather_full`. Pipeline stages own disjoint, globally numbered layers (:func:`merge_stages`)."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)
from impl.errors import AdapterGatherError

# isort: split

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import nn

from impl.adapter.build import AdapterState
from impl.adapter.dialects import match_native, native_adapter_name
from impl.vocabulary import TARGET_TABLE, TargetTable

__all__ = [
    "gather_adapter_state",
]


def unwrap_chunk(chunk: nn.Module) -> nn.Module:
    """The bare model inside any stack of wrappers that hold it as ``.module`` (DDP, Float16Module)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk


def _lora_hparams(handle_or_lora: Any) -> tuple[Any, list[list[str]] | None]:
    lora = getattr(handle_or_lora, "lora", handle_or_lora)
    for attr in ("dim", "alpha"):
        if not hasattr(lora, attr):
            raise AdapterGatherError(
                f"gather_adapter_state needs a LoraHandle or a Megatron-Bridge LoRA (with .dim/.alpha), got "
                f"{type(handle_or_lora).__name__}; pass make_lora_pre_wrap_hook(...).handle"
            )
    return lora, getattr(handle_or_lora, "wrapped", None)


def _tp_gather(param: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    local = value.detach()
    size = dist.get_world_size(group) if (group is not None and dist.is_initialized()) else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return local.to("cpu").clone()
    dim = int(getattr(param, "partition_dim", 0))
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([p.to("cpu") for p in parts], dim=dim)


def _adapter_tp_group(module: nn.Module) -> dist.ProcessGroup | None:
    group = getattr(module, "tp_group", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def adapter_parameters(chunks: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Parameter, dist.ProcessGroup | None]]:
    """This rank's LoRA parameters: (native global name, parameter, its TP group), in module order (the same on
    every rank of a TP group)."""
    for chunk in chunks:
        bare = unwrap_chunk(chunk)
        for mod_name, module in bare.named_modules():
            adapter = getattr(module, "adapter", None)
            if adapter is None or not all(hasattr(adapter, a) for a in ("linear_in", "linear_out")):
                continue
            group = _adapter_tp_group(adapter)
            for half in ("linear_in", "linear_out"):
                yield native_adapter_name(f"{mod_name}.adapter.{half}.weight"), getattr(adapter, half).weight, group


def gather_full(
    chunks: Sequence[nn.Module], value: Callable[[nn.Parameter], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """This stage's adapter tensors, TP-gathered (collective over the TP group, same order on every TP rank);
    ``value(param)``: a tensor laid out like the parameter to gather instead of it (an optimizer moment).

    Every Bridge ``ParallelLinearAdapter`` linear is a Megatron ``Column``/``RowParallelLinear`` whose weight carries
    ``tensor_model_parallel`` and ``partition_dim``: column-parallel bases give ``A``/``B`` split by rows, the
    row-parallel ``wo_b`` gives ``A`` split by columns and ``B`` by rows, replicated bases (``wq_a``, ``wkv``) also
    get row-split ``A``/``B`` (``gather_output=True``). Concatenating each TP group's shards along ``partition_dim``
    therefore reconstructs the full tensor for every kind.

    Why not Megatron-Bridge's ``stream_adapter_weights_megatron_to_hf``: Bridge 0.6.2's adapter export does not fit
    this graph.

    * ``_megatron_global_adapters_info_all_pp_ranks`` records ``base_linear_is_parallel=True`` for every
      ``ParallelLinearAdapter``, which is wrong for the replicated ``wq_a`` / ``wkv`` adapters;
    * it reads ``model.config.num_moe_experts`` (our chunks carry a ``ModelParallelConfig``) and maps names through
      HF base-weight mappings, so its output would be official names, not the native names the exporter takes;
    * nothing in it knows the grouped ``wo_a`` (harmless here only because its tensors are flat).
    """
    out: dict[str, torch.Tensor] = {}
    for name, param, group in adapter_parameters(chunks):
        if name in out:
            raise AdapterGatherError(f"{name} appears twice in this rank's chunks; virtual stages overlap")
        out[name] = _tp_gather(param, param if value is None else value(param), group)
    return out


def merge_stages(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's TP-gathered tensors merged, on every rank (collective over the pipeline group).

    Pipeline stages own disjoint (globally numbered) layers: each stage's TP-gathered tensors are exchanged over the
    pipeline group and merged."""
    stages: list[Any] = [local]
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_pipeline_model_parallel_group()
        if dist.get_world_size(group) > 1:
            stages = [None] * dist.get_world_size(group)
            dist.all_gather_object(stages, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage, tensors in enumerate(stages):
        for name, t in tensors.items():
            if name in merged and not torch.equal(merged[name], t):
                raise AdapterGatherError(
                    f"{name}: pipeline stage {stage} holds a different value than an earlier stage; layers must be "
                    "owned by exactly one stage (check the pipeline layout)"
                )
            merged[name] = t
    return dict(sorted(merged.items()))


def _declared(names: Sequence[str], table: TargetTable = TARGET_TABLE) -> tuple[list[str], dict[str, set[int]], bool]:
    """Exportable targets present, the layers of each, and whether every name is a plain decoder-attention one."""
    leaves: dict[str, set[int]] = {}
    plain = bool(names)
    for n in names:
        parsed = match_native(n, table)
        if parsed is None or parsed.layer is None:
            plain = False
            continue
        leaves.setdefault(parsed.row.native, set()).add(parsed.layer)
    order = [row.native for row in table.main if row.native in leaves]
    return order, leaves, plain


def gather_adapter_state(
    model_chunks: nn.Module | Sequence[nn.Module], handle_or_lora: Any, *, writer_rank: int | None = 0
) -> AdapterState | None:
    """Collective: every LoRA adapter tensor of ``model_chunks`` as FULL tensors under native global names.

    Call on every rank. Returns the :class:`AdapterState` on global rank ``writer_rank`` and ``None`` elsewhere
    (``writer_rank=None``: on every rank).
    ``handle_or_lora`` is the :class:`impl.lora.wrappers.LoraHandle` (or its ``DeepseekV4LoRA``) that built the adapters;
    ``r``/``alpha``/``dropout`` come from it. No adapters at all -> a state with no tensors (the exporter refuses
    it with :class:`impl.adapter.build.EmptyAdapterError`). ``targets``/``num_layers`` are filled only when every
    adapter is a decoder layer's exportable (main-attention)
    target, and ``num_layers`` only when every such leaf is present in every layer, so the
    exporter's coverage check applies without rejecting a deliberately layer-restricted adapter.
    """
    lora, _ = _lora_hparams(handle_or_lora)
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    merged = merge_stages(gather_full(chunks))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if writer_rank is not None and rank != writer_rank:
        return None
    order, leaves, plain = _declared(list(merged))
    num_layers = getattr(getattr(unwrap_chunk(chunks[0]), "v4_config", None), "num_layers", None)
    full_cover = num_layers is not None and plain and all(leaves[leaf] == set(range(num_layers)) for leaf in order)
    return AdapterState(
        tensors=merged,
        r=int(lora.dim),
        alpha=float(lora.alpha),
        dropout=float(getattr(lora, "dropout", 0.0)),
        targets=order if plain else None,
        num_layers=num_layers if full_cover else None,
    )
