"""One adapter training step on this rank's model chunk: the step ``qualify``, the cluster recipe's run and the
suites' end-to-end checks share. Under Megatron's DDP ``.grad`` is pointed at ``main_grad``, as Megatron's own
optimizer does (:func:`adapter_train_step`). Gradient clipping uses the whole model's norm, so every rank scales by
the same factor (:func:`clip_grad_norm`)."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch import nn

from impl.errors import UnsupportedConfigError
from impl.native.schedule import ManualPipeline

__all__ = [
    "adapter_train_step",
]


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of ``params`` (this rank's share of the model) so the model's total L2 norm is at most
    ``max_norm``; returns the norm before clipping, the same on every rank.

    The norm is of the whole model's trainable gradients: squares summed over the model-parallel group (tensor and
    pipeline ranks), counting a tensor that every tensor-parallel rank holds in full once, so every rank scales by
    the same factor."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.detach().float().pow(2).sum()
    if ps.model_parallel_is_initialized():
        group = ps.get_model_parallel_group()  # tensor x pipeline ranks: the data-parallel replicas agree already
        if dist.get_world_size(group=group) > 1:
            dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for g in grads:
            g.mul_(coeff)
    return norm


def adapter_train_step(
    model_chunks: Sequence[nn.Module],
    ids: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    *,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    clip_grad: float | None = None,
) -> float:
    """One optimizer step on the trainable (adapter) parameters of this rank's single model chunk.

    ``ids`` is the micro-batch ``[batch, seq]`` (the same on every rank of a pipeline); ``labels`` default to the
    next token (``ids`` rolled left by one). The loss is the mean per-token loss of the last pipeline stage, which
    is back-propagated through every stage. Returns that loss on every rank.

    The chunk may be wrapped in Megatron's DDP: its backward hooks accumulate gradients into ``main_grad`` and
    ``finish_grad_sync`` all-reduces them over the data-parallel group; the optimizer reads ``.grad``, so ``.grad``
    is pointed at ``main_grad`` (what Megatron's own optimizer does).
    """
    if len(model_chunks) != 1:
        raise UnsupportedConfigError(
            f"adapter_train_step runs one model chunk per rank, got {len(model_chunks)} (virtual pipeline stages "
            "need Megatron-Core's interleaved schedule)"
        )
    (chunk,) = model_chunks
    chunk.train()
    params = [p for p in chunk.parameters() if p.requires_grad]
    ddp = hasattr(chunk, "finish_grad_sync")
    optimizer.zero_grad(set_to_none=True)
    if ddp:
        chunk.zero_grad_buffer()
    labels = torch.roll(ids, -1, dims=1) if labels is None else labels
    loss = ManualPipeline(chunk).run(ids, position_ids, labels=labels, backward=True)
    if ddp:
        chunk.finish_grad_sync()
        for p in params:
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)
    if clip_grad is not None:
        clip_grad_norm(params, clip_grad)
    optimizer.step()
    return float(loss.float().mean())
