"""DeepSeek-V4 mixture of experts on Megatron-Core process groups (``docs/reference/v4_architecture.md`` §5.8).

The router is replicated and runs on all tokens on every rank, so it gets the full gradient (:class:`V4Router`).
Experts and the shared expert are clamped SwiGLU MLPs. Under expert parallelism each rank owns ``E / ep`` contiguous
experts and no token reaches an expert twice (:class:`V4MoE`); with EP = 1 the experts are replicated."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from torch import nn

from impl.errors import UnsupportedConfigError
from impl.native.activations import recompute
from impl.native.config import V4Config
from impl.native.parallel import resolve_tp_group

__all__ = [
    "V4Expert",
    "V4Experts",
    "V4MoE",
    "V4Router",
    "expert_parallel_layout",
]

_INIT_STD = 0.02
SUPPORTED_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` for ``gate_up = cat(gate, up)`` on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _linear_weight(out_features: int, in_features: int, dtype: torch.dtype) -> nn.Parameter:
    w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
    if not w.is_meta:  # a meta tensor has no values to draw (the memory model builds thousands of experts so)
        with torch.no_grad():
            nn.init.normal_(w, mean=0.0, std=_INIT_STD)
    return w


class _Linear(nn.Module):
    """Bias-free linear whose only tensor is ``.weight`` (native names ``linear_fc{1,2}.weight``)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _linear_weight(out_features, in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class V4Expert(nn.Module):
    """One clamped-SwiGLU MLP: ``linear_fc1.weight [2I, d] = cat(w1 gate, w3 up)``, ``linear_fc2.weight [d, I]``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        limit: float,
        *,
        params_dtype: torch.dtype,
        recompute_activation: bool = False,
    ) -> None:
        super().__init__()
        self.limit = limit
        self.recompute_activation = recompute_activation  # selective 'moe_act'
        self.linear_fc1 = _Linear(hidden_size, 2 * intermediate_size, params_dtype)
        self.linear_fc2 = _Linear(intermediate_size, hidden_size, params_dtype)

    def _activation_and_down(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(clamped_swiglu(h, self.limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self.recompute_activation, self._activation_and_down, self.linear_fc1(x))


class V4Router(nn.Module):
    """``weight [E, d]``; ``expert_bias`` fp32 buffer [E] (score routing) or ``tid2eid`` int64 buffer [V, k] (hash).

    Routing (replicated, per rank, on that rank's own tokens): ``s = sqrt(softplus(x @ W^T))`` in fp32; the
    selection is ``topk(s + expert_bias)`` on score-routed layers or the static ``tid2eid[input_ids]`` on hash
    layers; the weights are ``s`` gathered at the selection, normalized, times ``routed_scaling_factor``.
    """

    def __init__(self, config: V4Config, *, hash_routed: bool, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.scoring_func not in SUPPORTED_SCORING_FUNCS:
            raise UnsupportedConfigError(
                f"scoring_func={config.scoring_func!r} is not supported by the native V4 router; "
                f"use one of {SUPPORTED_SCORING_FUNCS}"
            )
        self.hash_routed = hash_routed
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = _linear_weight(config.n_routed_experts, config.hidden_size, params_dtype)
        if hash_routed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64), persistent=True
            )
        else:
            self.register_buffer("expert_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> ``(weights [T, k] fp32, indices [T, k] int64)``."""
        # fp32 routing math (OFF computes the gate in fp32; identical to the oracle for fp32 activations).
        scores = _score(F.linear(x.float(), self.weight.float()), self.scoring_func)
        if self.hash_routed:
            if input_ids is None:
                raise ValueError("hash-routed MoE layer needs input_ids (tid2eid routing); pass them to forward")
            indices = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            indices = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        # transformers normalizes unconditionally for V4 (norm_topk_prob is True in every V4 config).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


def expert_parallel_layout(config: V4Config, ep_size: int) -> int:
    """Experts per EP rank; raises :class:`UnsupportedConfigError` when ``E % ep != 0``."""
    if ep_size < 1 or config.n_routed_experts % ep_size != 0:
        raise UnsupportedConfigError(
            f"n_routed_experts={config.n_routed_experts} is not divisible by expert_model_parallel_size={ep_size}; "
            "choose an expert-parallel size that divides the number of routed experts"
        )
    return config.n_routed_experts // ep_size


def _ep_state() -> tuple[dist.ProcessGroup | None, int, int]:
    """Megatron's expert-model-parallel ``(group, size, rank)``; no group (size 1) when not initialized."""
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return (
            parallel_state.get_expert_model_parallel_group(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank(),
        )
    return None, 1, 0


class V4Experts(nn.Module):
    """This rank's ``E / ep`` routed experts as ``local_experts.{e}`` (``e`` local; global id = offset + e)."""

    def __init__(
        self,
        config: V4Config,
        *,
        ep_size: int,
        ep_rank: int,
        params_dtype: torch.dtype = torch.float32,
        recompute_activation: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.num_local_experts = expert_parallel_layout(config, ep_size)
        self.local_expert_offset = ep_rank * self.num_local_experts
        self.local_experts = nn.ModuleList(
            V4Expert(
                config.hidden_size,
                config.moe_intermediate_size,
                config.swiglu_limit,
                params_dtype=params_dtype,
                recompute_activation=recompute_activation,
            )
            for _ in range(self.num_local_experts)
        )
        for p in self.parameters():
            p.allreduce = False  # Megatron DDP: expert params reduce over the expert-data-parallel group

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the local experts' outputs for ``x [T, d]`` (zero for tokens routed elsewhere)."""
        out = torch.zeros_like(x)
        # [k, T] like the oracle's one-hot mask, so torch.where yields the same (slot, token) order.
        slots = indices.transpose(0, 1)
        for e, expert in enumerate(self.local_experts):
            k_pos, token_idx = torch.where(slots == self.local_expert_offset + e)
            # Unhit experts still run on zero tokens: a zero (not None) gradient keeps DDP buckets uniform.
            y = expert(x[token_idx]) * weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class V4MoE(nn.Module):
    """``router``, ``experts`` (EP-local) and ``shared_experts``; ``forward(x [B,S,d], input_ids) -> [B,S,d]``.

    Expert parallelism: each rank of Megatron's expert-model-parallel group owns ``E / ep`` contiguous experts.
    Tokens, routing weights and selections are all-gathered over that group, each rank applies its local experts
    to every gathered token, and the partial outputs are reduce-scattered back (Megatron's autograd-aware
    sequence-parallel mappings, so the backward is the matching reduce-scatter / all-gather). Under TP the ranks of
    a TP group hold the same tokens; with EP > 1 each TP rank first keeps only its 1/tp share of the tokens (and
    all-gathers the result afterwards) so no token reaches an expert twice. Routing runs on all tokens on every
    rank (replicated router, full gradient). With EP = 1 the experts are replicated and see every token.
    """

    def __init__(
        self,
        config: V4Config,
        *,
        hash_routed: bool,
        ep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        recompute_activation: bool = False,
    ) -> None:
        super().__init__()
        tp_group, tp_size, tp_rank = resolve_tp_group(tp_group)
        self.tp_group = tp_group if tp_size > 1 else None
        self.tp_size, self.tp_rank = tp_size, tp_rank
        if ep_group is None:
            ep_group, ep_size, ep_rank = _ep_state()
        else:
            ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self.ep_group = ep_group if ep_size > 1 else None
        self.ep_size = ep_size
        self.hidden_size = config.hidden_size
        self.router = V4Router(config, hash_routed=hash_routed, params_dtype=params_dtype)
        self.experts = V4Experts(
            config,
            ep_size=ep_size,
            ep_rank=ep_rank,
            params_dtype=params_dtype,
            recompute_activation=recompute_activation,
        )
        self.shared_experts = (
            V4Expert(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.swiglu_limit,
                params_dtype=params_dtype,
                recompute_activation=recompute_activation,
            )
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, self.hidden_size)
        weights, indices = self.router(flat, input_ids)
        if self.ep_group is None:
            routed = self.experts(flat, weights, indices)
        else:
            routed = self._expert_parallel(flat, weights, indices)
        routed = routed.view(shape)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(hidden_states)

    def _expert_parallel(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        split = self.tp_group is not None
        if split:
            if flat.shape[0] % self.tp_size != 0:
                raise UnsupportedConfigError(
                    f"MoE with EP={self.ep_size} and TP={self.tp_size}: {flat.shape[0]} tokens per rank are not "
                    f"divisible by TP={self.tp_size}; use a batch*sequence size that is"
                )
            # Forward: keep this TP rank's share; backward: all-gather (downstream is replicated over TP).
            flat = scatter_to_sequence_parallel_region(flat, group=self.tp_group)
            weights = scatter_to_sequence_parallel_region(weights, group=self.tp_group)
            indices = indices.chunk(self.tp_size, dim=0)[self.tp_rank]
        # Every EP rank must contribute the same number of tokens (equal-split gather / reduce-scatter).
        x_all = gather_from_sequence_parallel_region(flat, group=self.ep_group)
        w_all = gather_from_sequence_parallel_region(weights, group=self.ep_group)
        with torch.no_grad():
            idx_all = gather_from_sequence_parallel_region(indices, group=self.ep_group)
        out = reduce_scatter_to_sequence_parallel_region(self.experts(x_all, w_all, idx_all), group=self.ep_group)
        if split:
            # Forward: all-gather the shares; backward: keep this rank's slice (no sum over identical TP grads).
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=self.tp_group)
        return out
