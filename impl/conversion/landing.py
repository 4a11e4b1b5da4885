"""Where Megatron-Bridge's mapping puts each checkpoint tensor inside a native parameter, learned from Bridge itself.

Where Bridge only places tensors, the loader can dequantize straight into the parameter and skip Bridge's copies
(docs/performance.md). Those places are never assumed: :func:`landing_views` asks the mapping with a probe and
returns None, so the load takes Bridge's path, unless each input provably lands whole, in order, in one span.
Only for ranks whose mapping has tensor-parallel size 1: there the probe can never meet a collective."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import torch

__all__ = [
    "landing_views",
]

_LANDINGS: dict[tuple, dict[str, tuple[int, tuple[int, ...]]] | None] = {}  # probe results, per process


def landing_views(
    row: Hashable,
    mapping: Any,
    module: torch.nn.Module,
    param: torch.Tensor,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor] | None:
    """Views of ``param`` where ``mapping`` (built from the table row ``row``) would place each input (``shapes``:
    input key -> shape; the key ``""`` for a mapping that takes one tensor), or None when Bridge does more than
    place them. What a row's mapping does can depend on the module (``AutoMapping`` reads its class), the
    parameter (its device: ``ReplicatedMapping`` moves its input there) and the input shapes: all of them key the
    probe.

    Why: the strict load hands each checkpoint tensor to the row's Bridge mapping (``hf_to_megatron``) and copies the
    result into the parameter. For a quantized weight on a rank without tensor parallelism that costs a full-size
    dequantized tensor, Bridge's concatenation of gate and up (a fresh allocation) and the copy: more work than the
    dequantization itself. The probe runs once per table row, module class, parameter and input shapes; its every
    element holds its own index, and views are returned only when the result proves each input lands whole, in
    order, in one contiguous span. Anything else (tensor parallelism, transposes, casts, padding, a Bridge version
    that lays things out differently) returns None. Only for tensor-parallel size 1: there Bridge's mappings
    communicate with no one, so the probe, run on any rank at any point of its plan, can never meet a collective.
    """
    if type(param.data) is not torch.Tensor or not param.is_contiguous():  # a DTensor shard, a strided view
        return None
    key = (row, type(mapping), type(module), param.device.type, param.dtype, param.shape, tuple(sorted(shapes.items())))
    if key not in _LANDINGS:
        _LANDINGS[key] = _probe(mapping, module, param, dict(shapes))
    spans = _LANDINGS[key]
    if spans is None:
        return None
    flat = param.view(-1)
    return {k: flat[start : start + math.prod(shape)].view(shape) for k, (start, shape) in spans.items()}


def _probe(
    mapping: Any, module: torch.nn.Module, param: torch.Tensor, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, tuple[int, ...]]] | None:
    """Run Bridge's mapping on index tensors (input ``k`` holds ``offset_k .. offset_k + n_k - 1``) and read back
    where every input went: a contiguous span per input, all of the parameter covered, or None. One input: Bridge
    must hand back the very tensor (no values needed, so the probe touches no memory)."""
    total = sum(math.prod(s) for s in shapes.values())
    if total != param.numel():
        return None
    index_dtype = torch.int32 if total < 2**31 else torch.int64
    if list(shapes) == [""]:
        source = torch.empty(shapes[""], dtype=index_dtype, device=param.device)
        result = _run(mapping, source, module)
        return {"": (0, tuple(shapes[""]))} if result is source else None
    offsets, sources, start = {}, {}, 0
    for k, shape in shapes.items():
        offsets[k] = start
        sources[k] = torch.arange(start, start + math.prod(shape), dtype=index_dtype, device=param.device).view(shape)
        start += math.prod(shape)
    result = _run(mapping, sources, module)
    if not isinstance(result, torch.Tensor) or result.dtype != index_dtype or tuple(result.shape) != param.shape:
        return None
    flat, spans, pos = result.reshape(-1), {}, 0
    by_offset = {offsets[k]: k for k in shapes}
    while pos < total:
        k = by_offset.get(int(flat[pos]))
        if k is None or k in spans or not torch.equal(flat[pos : pos + sources[k].numel()], sources[k].view(-1)):
            return None
        spans[k] = (pos, tuple(shapes[k]))
        pos += sources[k].numel()
    return spans


def _run(mapping: Any, inputs: Any, module: torch.nn.Module) -> Any:
    try:
        return mapping.hf_to_megatron(inputs, module)
    except Exception:  # Bridge refuses index tensors (a dtype or shape check): the load takes Bridge's own path
        return None
