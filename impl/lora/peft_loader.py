"""Load an exported DeepSeek-V4 adapter with HF PEFT so that the grouped ``o_a_proj`` works unmerged too.

Stock PEFT wraps transformers' ``DeepseekV4GroupedLinear`` with its dense LoRA ``Linear``, whose unmerged forward fails
on the grouped shapes; ``merge_and_unload`` is right. :class:`GroupedLoraLinear` makes the unmerged forward right too,
computing the same function as the native grouped LoRA (:func:`impl.lora.wrappers.apply_grouped_wo_a`).
No megatron import: this is the consumer side."""

from __future__ import annotations

import os
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from impl.errors import GroupedLoRAError

__all__ = [
    "GroupedLoraLinear",
    "load_peft_adapter",
]


class GroupedLoraLinear(PeftLoraLinear):
    """PEFT LoRA layer for ``DeepseekV4GroupedLinear``: block-diagonal unmerged forward; merge is PEFT's own.

    transformers' ``DeepseekV4GroupedLinear`` (``self_attn.o_a_proj``) is an ``nn.Linear`` of weight
    ``[G*R, H*D/G]`` whose forward applies rows ``g*R .. (g+1)*R`` to input group ``g`` only. Stock PEFT's dense
    unmerged forward adds ``lora_B(lora_A(x))`` (``[.., G, G*R]``) to every group's output (``[.., G, R]``) and
    fails. ``merge_and_unload`` is right, because ``W + (alpha/r) B@A`` has the weight's shape; this layer adds only
    the diagonal blocks: group ``g`` gets ``(alpha/r) * B_g @ A @ x_g`` with ``B_g`` the rows of group ``g``.
    """

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("adapter_names") is not None:
            raise GroupedLoRAError("mixed-adapter batches are not supported on the grouped o_a_proj; merge instead")
        if self.disable_adapters or self.merged:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        out_dtype = result.dtype
        groups = self.get_base_layer().n_groups
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            if name in self.lora_variant or self.lora_B[name].bias is not None:
                raise GroupedLoRAError(
                    f"adapter {name!r} on the grouped o_a_proj uses a LoRA variant or a bias; only plain LoRA is grouped"
                )
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            h = lora_a(self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype)))  # [.., G, r]
            blocks = lora_b.weight.view(groups, -1, lora_b.weight.shape[-1])  # [G, R, r]: B_g per group
            result = result + torch.einsum("...gk,grk->...gr", h, blocks) * self.scaling[name]
        return result.to(out_dtype)


def load_peft_adapter(
    model: nn.Module,
    adapter_dir: str | os.PathLike,
    *,
    merge: bool = False,
    adapter_name: str = "default",
    is_trainable: bool = False,
) -> nn.Module:
    """``PeftModel.from_pretrained`` with :class:`GroupedLoraLinear` registered for the grouped ``o_a_proj``.

    Returns the ``PeftModel`` (unmerged: adapters stay separate, so they can be disabled or swapped) or, with
    ``merge=True``, the merged plain model (``merge_and_unload``). ``model`` is transformers'
    ``DeepseekV4ForCausalLM`` of the base the adapter was trained against."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    config = LoraConfig.from_pretrained(str(adapter_dir))
    config._register_custom_module({DeepseekV4GroupedLinear: GroupedLoraLinear})  # PEFT's documented extension
    peft_model = PeftModel.from_pretrained(
        model, str(adapter_dir), adapter_name=adapter_name, config=config, is_trainable=is_trainable
    )
    return peft_model.merge_and_unload() if merge else peft_model
