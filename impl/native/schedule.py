"""One micro-batch through this rank's pipeline stage by hand: plain p2p send/recv of the stream tensor forward,
of its gradient backward, and the last stage's output broadcast to every stage.

Enough for ``qualify``, the cluster recipe's smoke run and the suites' multi-rank checks (one model chunk per rank,
one micro-batch in flight). It is not a training schedule: no 1F1B, no interleaving, no communication overlap; use
Megatron-Core's schedules for real training. With PP = 1 every method is a plain call on the chunk."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import nn

__all__ = [
    "ManualPipeline",
]


class ManualPipeline:
    """This rank's stage of a pipeline-parallel native model (``chunk`` may be DDP-wrapped)."""

    def __init__(self, chunk: nn.Module) -> None:
        self.chunk = chunk
        self.model = getattr(chunk, "module", chunk)
        self.pp = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        self.first = self.pp == 1 or ps.is_pipeline_first_stage()
        self.last = self.pp == 1 or ps.is_pipeline_last_stage()
        self._sent: torch.Tensor | None = None
        self._received: torch.Tensor | None = None

    def _stream_buffer(self, ids: torch.Tensor) -> torch.Tensor:
        """The receive buffer of a non-first stage. Streams keep the embedding's dtype through every layer
        (impl.native.hyper.hc_post), and the embedding is built in the model's ``params_dtype``."""
        cfg = self.model.v4_config
        dtype = getattr(getattr(self.model, "config", None), "params_dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        return torch.empty(ids.shape[0], ids.shape[1], cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=ids.device)

    def forward(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        requires_grad: bool = False,
    ) -> torch.Tensor | None:
        """Run this stage; the last stage returns logits (or per-token loss with ``labels``), the others None."""
        if not self.first:
            buf = self._stream_buffer(ids)
            dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
            self._received = buf.requires_grad_(requires_grad)
            self.model.set_input_tensor(self._received)
        if not self.last:
            streams = self.chunk(ids, position_ids)
            dist.send(streams.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            self._sent = streams
            return None
        return self.chunk(ids, position_ids, labels=labels)

    def backward(self, loss: torch.Tensor | None) -> None:
        """Back-propagate ``loss`` (given on the last stage, None elsewhere) through every stage."""
        if self.last:
            if loss is None:
                raise ValueError("the last pipeline stage needs the loss to back-propagate")
            loss.backward()
        else:
            grad = torch.empty_like(self._sent)
            dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
            self._sent.backward(grad)
        if not self.first:
            dist.send(self._received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
        self._sent = self._received = None

    def broadcast_output(self, out: torch.Tensor | None) -> torch.Tensor:
        """The last stage's ``out`` (detached) on every stage of this pipeline."""
        if self.pp == 1:
            return out.detach()
        holder = [out.detach() if self.last else None]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(holder, src=src, group=ps.get_pipeline_model_parallel_group())
        return holder[0]

    def run(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        backward: bool = False,
    ) -> torch.Tensor:
        """Forward (and, with ``backward``, back-propagate the mean of the output); the output on every stage."""
        out = self.forward(ids, position_ids, labels=labels, requires_grad=backward)
        if backward:
            self.backward(out.mean() if self.last else None)
        return self.broadcast_output(out)
