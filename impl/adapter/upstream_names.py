"""Adapter tensors named in the upstream Megatron-Core layout, read through the mapping table.

Users who trained on upstream Megatron-Core's ``dsv4_hybrid`` graph hold Megatron-Bridge LoRA tensors under upstream
module names; the exporter speaks Miles names. Both are rows of :data:`impl.conversion.mapping.MAPPING_TABLE`, so no
second name table exists (:func:`miles_adapter_name`). No megatron import: exporter ranks stay light."""

from __future__ import annotations

from impl.conversion.mapping import lookup_official, lookup_upstream
from impl.errors import UpstreamAdapterError

__all__ = ["ADAPTER_HALVES", "UpstreamAdapterError", "miles_adapter_name"]

#: Megatron-Bridge's two LoRA halves, as the suffix after ``<module>.adapter.``.
ADAPTER_HALVES = ("linear_in.weight", "linear_out.weight")


def miles_adapter_name(name: str) -> str | None:
    """The Miles-layout name of an upstream-layout Megatron-Bridge LoRA tensor name; None when ``name`` is not one.

    Raises :class:`UpstreamAdapterError` for an adapter on a name the upstream graph holds as a raw parameter
    (``linear_o_group_proj``, the grouped ``wo_a``): Bridge's LoRA wraps modules, so no such adapter exists.

    Megatron-Bridge's LoRA wraps a module ``M`` and names its tensors ``M.adapter.linear_in.weight`` (lora_A) and
    ``M.adapter.linear_out.weight`` (lora_B); upstream names look like
    ``decoder.layers.3.self_attention.linear_q_up_proj.adapter.linear_in.weight``, Miles names like
    ``...self_attention.wq_b.adapter...``. The base weight ``M.weight`` resolves upstream -> official -> Miles.
    """
    module, sep, half = name.rpartition(".adapter.")
    if not sep or half not in ADAPTER_HALVES:
        return None
    hit = lookup_upstream(module + ".weight")
    if hit is None:
        if lookup_upstream(module) is not None:
            raise UpstreamAdapterError(
                f"adapter tensor {name!r}: upstream Megatron-Core holds {module.rpartition('.')[2]!r} as a raw "
                "nn.Parameter, not a module, so Megatron-Bridge's LoRA cannot wrap it and no upstream adapter "
                "targets it; train that target in the Miles layout (grouped wo_a) or drop these tensors"
            )
        return None
    miles = lookup_official(hit[2][0])
    if miles is None:  # every official name of the table resolves; kept for a table under construction
        return None
    return f"{miles[2].removesuffix('.weight')}.adapter.{half}"
