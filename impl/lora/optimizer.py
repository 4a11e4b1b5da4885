"""Adam on the LoRA adapters with fp32 master weights and fp32 gradients, on any device.

It does what Megatron's bf16 optimizer does, which allocates its bookkeeping on ``'cuda'`` unconditionally, with
``torch.optim.AdamW`` on any device (:class:`AdapterOptimizer`). Gradient clipping must use the global norm over the
model-parallel group, counting a TP-replicated tensor once, or the TP replicas of ``wq_a`` / ``wkv`` drift apart."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch import nn

from impl.errors import TargetError

__all__ = [
    "AdapterOptimizer",
]


def _trainable(model_chunks: nn.Module | Iterable[nn.Module]) -> list[nn.Parameter]:
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    seen: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


class AdapterOptimizer:
    """AdamW over the trainable parameters of ``model_chunks`` with fp32 masters; ``step()`` returns the grad norm.

    Call ``zero_grad()`` (and the DDP chunk's ``zero_grad_buffer()``) before each backward, ``finish_grad_sync()``
    after it, then ``step()``. Gradients are read from ``main_grad`` when DDP keeps one, else from ``.grad``.

    What Megatron does for bf16 training (``Float16OptimizerWithFloat16Params`` behind ``get_megatron_optimizer``
    with ``OptimizerConfig(bf16=True)``): the model's parameters are bf16, DDP reduces their gradients into fp32
    ``main_grad`` buffers (``grad_reduce_in_fp32``), the optimizer steps fp32 master copies and writes them back to
    the bf16 parameters. Megatron-Core 0.19's optimizers allocate their bookkeeping on ``'cuda'`` unconditionally,
    so this class does the same on any device. fp32 parameters are their own masters.

    Gradient clipping uses the global norm: squares of every rank's adapter gradients summed over the model-parallel
    group (TP x PP), counting a TP-replicated tensor once, as Megatron's ``get_grad_norm_fp32``; a per-rank norm
    would scale the replicas of ``wq_a`` / ``wkv`` differently on different TP ranks and let them drift apart.
    """

    def __init__(
        self,
        model_chunks: nn.Module | Iterable[nn.Module],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        clip_grad: float | None = None,
    ) -> None:
        self.params = _trainable(model_chunks)
        if not self.params:
            raise TargetError("no trainable parameters: apply LoRA (impl.make_lora_pre_wrap_hook) before the optimizer")
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        #: the fp32 copies of the non-fp32 parameters (Megatron's attribute name, walked by impl.audit_devices)
        self.fp32_from_float16_groups = [[m for m, p in zip(self.masters, self.params, strict=True) if m is not p]]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.clip_grad = clip_grad

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (``set_to_none`` is accepted as torch optimizers take it; they are always dropped)."""
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def _grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        for p, m in zip(self.params, self.masters, strict=True):
            if m.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                local += m.grad.float().square().sum()
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            dist.all_reduce(local, group=parallel_state.get_model_parallel_group())
        return float(local.sqrt())

    def step(self) -> float:
        """One AdamW step on the fp32 masters (after clipping), copied back into the parameters; the grad norm."""
        for p, m in zip(self.params, self.masters, strict=True):
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            m.grad = None if g is None else g.to(torch.float32)
        norm = self._grad_norm()
        if self.clip_grad and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(scale)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        return norm
