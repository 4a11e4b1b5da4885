"""Megatron-Core parallel-layer plumbing shared by the native V4 modules.

Megatron's parallel linears read a ``ModelParallelConfig`` and the native modules a
:class:`~impl.native.config.V4Config`; :func:`megatron_parallel_config` bridges the two, with no fused kernels and no
sequence parallelism. Placement is decided once, by :func:`cpu_initialization`."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from impl.errors import UnsupportedConfigError
from impl.native.config import V4Config
from impl.native.rope import NATIVE_ROPE_FUSED

__all__ = [
    "cpu_initialization",
]

DEFAULT_INIT_STD = 0.02


def normal_init(std: float = DEFAULT_INIT_STD) -> Callable[[torch.Tensor], None]:
    """An ``init_method`` for Megatron parallel layers (applied to the full master weight on CPU)."""

    def init_(tensor: torch.Tensor) -> None:
        if not tensor.is_meta:  # nothing to draw on the meta device
            torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, size, rank)`` of the tensor-parallel group: the given one, else Megatron's, else none (size 1)."""
    if tp_group is None and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_group is None or not dist.is_initialized():
        return None, 1, 0
    return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)


def cpu_initialization() -> bool:
    """True when parameters are to be created on the CPU: no CUDA, or an ambient ``torch.device("meta")``.

    On a CUDA host the config asks for GPU initialization, so Megatron's parallel layers allocate on
    ``torch.cuda.current_device()`` and Megatron-Bridge's ``get_model`` moves the rest of each chunk there (it reads
    ``use_cpu_initialization`` from the *model's* config, never the provider's). Without CUDA, or while building
    under ``torch.device("meta")`` (the memory model), the CPU-initialization path is used: it is the one that
    honours the ambient default device.
    """
    return not torch.cuda.is_available() or torch.empty(0).device.type == "meta"


def place_on_init_device(module: torch.nn.Module) -> None:
    """On a CUDA host Megatron's parallel layers were created on the current GPU: move the rest of ``module``
    there too, so a block built on its own (not through the provider) is never split across devices."""
    if not cpu_initialization():
        module.to(torch.cuda.current_device())


def megatron_parallel_config(
    cfg: V4Config,
    *,
    params_dtype: torch.dtype = torch.float32,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    perform_initialization: bool = True,
    use_cpu_initialization: bool | None = None,
) -> ModelParallelConfig:
    """A Megatron config for the parallel linears inside the native V4 graph.

    It is a ``TransformerConfig`` (a ``ModelParallelConfig`` subclass) because Megatron's DDP and
    Megatron-Bridge's ``get_model`` read transformer-level fields from ``model.config``.
    ``use_cpu_initialization`` defaults to :func:`cpu_initialization` (False on a CUDA host).
    """
    if use_cpu_initialization is None:
        use_cpu_initialization = cpu_initialization()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.moe_intermediate_size,
        num_moe_experts=cfg.n_routed_experts,
        normalization="RMSNorm",
        add_bias_linear=False,
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        sequence_parallel=False,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        params_dtype=params_dtype,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        # the native rope is never Megatron's; the config states what the graph does (impl.native.rope)
        apply_rope_fusion=NATIVE_ROPE_FUSED,
    )


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's vocab-parallel cross entropy over ``tp_group``.

    Megatron-Core before 0.19 takes no ``tp_group`` and always reduces over its own tensor-parallel group, which is
    the same reduction when ``tp_group`` is that group (or there is none); any other group is refused by name.
    """
    loss = tensor_parallel.vocab_parallel_cross_entropy
    if "tp_group" in inspect.signature(loss).parameters:
        return loss(logits, labels, tp_group=tp_group)
    if tp_group is not None and tp_group is not parallel_state.get_tensor_model_parallel_group():
        raise UnsupportedConfigError(
            "this megatron-core's vocab_parallel_cross_entropy reduces over Megatron's own tensor-parallel group "
            "only (no tp_group argument before 0.19); build the model on that group or install megatron-core >= 0.19"
        )
    return loss(logits, labels)
