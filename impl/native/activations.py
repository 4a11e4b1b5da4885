"""How the native graph keeps its activations: attention by query blocks above a length, and recompute.

:class:`ActivationPlan` carries Megatron's recompute options, under ``TransformerConfig``'s names, and the attention's
memory-efficient path; the provider hands one plan to every native layer. Blocked attention gives exactly the
unblocked result, because the masked-out keys contribute nothing; it only avoids the full score tensor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from impl.errors import UnsupportedConfigError

__all__ = [
    "ActivationPlan",
]

GRANULARITIES = (None, "full", "selective")
METHODS = ("uniform", "block")
SELECTIVE_MODULES = ("core_attn", "mhc", "moe_act")


@dataclass(frozen=True)
class ActivationPlan:
    """Megatron's recompute options (``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` /
    ``recompute_modules``) and the attention's memory-efficient path.

    * ``granularity=None``: nothing is recomputed.
    * ``"full"``: whole decoder layers are checkpointed (only their input streams are kept). ``method="uniform"``
      checkpoints groups of ``num_layers`` consecutive layers; ``"block"`` checkpoints the first ``num_layers``
      layers of the stage one by one and keeps the rest.
    * ``"selective"``: only the named parts recompute: ``core_attn`` (softmax attention, per query block), ``mhc``
      (the hyper-connection pre-mix with its fp32 stream norm), ``moe_act`` (each expert's activation and down
      projection).

    Above ``attention_chunk_threshold`` tokens the attention runs over query blocks of ``attention_query_block``:
    each block sees only its sliding-window band of raw keys plus the compressed entries (the masked-out keys
    contribute exactly nothing), so the ``[B, H, S, S + W]`` score tensor never exists.
    """

    recompute_granularity: str | None = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ()
    attention_chunk_threshold: int = 1024
    attention_query_block: int = 256

    def __post_init__(self) -> None:
        problems = []
        if self.recompute_granularity not in GRANULARITIES:
            problems.append(f"recompute_granularity={self.recompute_granularity!r} is not one of {GRANULARITIES}")
        if self.recompute_method not in METHODS:
            problems.append(f"recompute_method={self.recompute_method!r} is not one of {METHODS}")
        if self.recompute_num_layers < 1:
            problems.append(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")
        unknown = [m for m in self.recompute_modules if m not in SELECTIVE_MODULES]
        if unknown:
            problems.append(f"recompute_modules {unknown} are not among {SELECTIVE_MODULES}")
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            problems.append("recompute_granularity='selective' needs recompute_modules")
        if self.attention_query_block < 1 or self.attention_chunk_threshold < 0:
            problems.append(
                f"attention_query_block={self.attention_query_block} must be >= 1 and "
                f"attention_chunk_threshold={self.attention_chunk_threshold} >= 0"
            )
        if problems:
            raise UnsupportedConfigError("activation plan: " + "; ".join(problems))

    def selective(self, module: str) -> bool:
        """Whether the selective-recompute part ``module`` (a :data:`SELECTIVE_MODULES` name) recomputes."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def checkpointed_layers(self, count: int) -> list[list[int]]:
        """Positions (0-based, this stage) of the layers, grouped as they run: a group of several layers is one
        checkpoint; a single layer is checkpointed only where full recompute covers it."""
        if self.recompute_granularity != "full":
            return [[i] for i in range(count)]
        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            return [list(range(i, min(i + n, count))) for i in range(0, count, n)]
        return [[i] for i in range(count)]

    def layer_is_recomputed(self, position: int) -> bool:
        if self.recompute_granularity != "full":
            return False
        return self.recompute_method == "uniform" or position < self.recompute_num_layers

    def uses_chunked_attention(self, seq_len: int) -> bool:
        return seq_len > self.attention_chunk_threshold


def recompute(enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, through a non-reentrant activation checkpoint when ``enabled`` and autograd is recording.

    The RNG state is preserved (``preserve_rng_state``), so LoRA dropout draws the same masks when recomputed.
    """
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
