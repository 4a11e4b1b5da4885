"""Native DeepSeek-V4 attention on Megatron-Core (prefill, no KV cache; ``docs/reference/v4_architecture.md`` §5.3).

Its forward semantics and op order are those of transformers' ``DeepseekV4Attention``, which it must keep matching.
Heads and ``wo_a`` groups are split over TP ranks; everything before the heads is replicated, and the shared KV's
gradient is summed over ranks. The attention itself and its TP layout: :class:`DeepseekV4Attention`."""

from __future__ import annotations

from functools import partial

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)
from impl.errors import AttentionInputError

# isort: split
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from torch import nn

from impl.errors import GroupedLoRAError, UnsupportedConfigError
from impl.native.activations import ActivationPlan, recompute
from impl.native.compressor import Compressor
from impl.native.config import V4Config
from impl.native.indexer import INDEXER_RATIO, Indexer
from impl.native.norm import ReplicatedLinear, RMSNorm, unweighted_rms_norm
from impl.native.parallel import (
    DEFAULT_INIT_STD,
    megatron_parallel_config,
    normal_init,
    place_on_init_device,
    resolve_tp_group,
)
from impl.native.rope import apply_interleaved_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "DeepseekV4Attention",
    "grouped_wo_a",
]


def grouped_wo_a(module: nn.Module, x_grouped: torch.Tensor, *, groups: int, group_out: int) -> torch.Tensor:
    """Grouped ``wo_a``: ``x_grouped [B, S, G, H*D/G]`` with ``module.weight [G*R, H*D/G]`` -> ``[B, S, G, R]``.

    Group ``g`` only sees its own head block: ``z_g = x_g @ W_g^T`` with ``W = weight.view(G, R, H*D/G)``.
    ``G`` is the rank-local group count under TP. A wrapper that replaces ``wo_a`` (an adapter) runs the grouped
    product itself through its ``grouped_forward``: the base graph knows no adapter, only that hook.
    """
    weight = getattr(module, "to_wrap", module).weight
    in_per_group = x_grouped.shape[-1]
    if x_grouped.dim() != 4 or x_grouped.shape[-2] != groups:
        raise GroupedLoRAError(
            f"wo_a input must be [B, S, groups={groups}, H*D/G], got {tuple(x_grouped.shape)}; "
            "reshape the attention output into its head groups first"
        )
    if weight.shape != (groups * group_out, in_per_group):
        raise GroupedLoRAError(
            f"wo_a.weight has shape {tuple(weight.shape)}, expected (groups*o_lora_rank, H*D/G) = "
            f"({groups * group_out}, {in_per_group}) for {groups} local groups; check the TP split of wo_a"
        )
    grouped_forward = getattr(module, "grouped_forward", None)
    if grouped_forward is not None:
        return grouped_forward(x_grouped, groups=groups, group_out=group_out)
    if hasattr(module, "to_wrap"):  # a wrapper without the hook would have its own output dropped silently
        raise GroupedLoRAError(
            f"wo_a is wrapped by {type(module).__name__}, which has no grouped_forward(x_grouped, groups=, "
            "group_out=); the grouped wo_a runs only under a wrapper that computes the grouped product"
        )
    return torch.einsum("bsgd,grd->bsgr", x_grouped, weight.view(groups, group_out, in_per_group))


def _check_layout(config: V4Config, layer_number: int, ratio: int, tp_size: int) -> None:
    """Refuse, before any allocation, a layer whose heads, groups or rope cannot be laid out on ``tp_size`` ranks."""
    if ratio < 0:
        raise UnsupportedConfigError(f"layer {layer_number}: compress ratio must be >= 0, got {ratio}")
    heads, groups = config.num_heads, config.o_groups
    if groups <= 0 or heads % groups:
        raise UnsupportedConfigError(
            f"layer {layer_number}: num_heads={heads} is not divisible by o_groups={groups}; "
            "wo_a groups must be whole head blocks"
        )
    if heads % tp_size or groups % tp_size:
        raise UnsupportedConfigError(
            f"layer {layer_number}: tensor parallel size {tp_size} must divide num_heads={heads} and "
            f"o_groups={groups}; pick a TP size that divides both"
        )
    if config.rope_head_dim > config.head_dim or config.rope_head_dim % 2:
        raise UnsupportedConfigError(
            f"rope_head_dim={config.rope_head_dim} must be even and <= head_dim={config.head_dim}"
        )


class DeepseekV4Attention(MegatronModule):
    """V4 attention for decoder layer ``layer_number`` (0-based). ``compress_ratio`` overrides the config's.

    Shared-KV MQA (one KV head, K == V) over a causal sliding window of raw tokens plus, on compressed layers,
    the compressor's entries (HCA: every visible entry; CSA: the indexer's top-k). A per-head learned sink joins
    only the softmax denominator. The value side carries RoPE, so the output's rope slice gets the conjugate
    rotation at the query position before the grouped low-rank output projection (``wo_a`` per head group, then
    ``wo_b``). Forward semantics and op order are those of transformers' ``DeepseekV4Attention``.

    Tensor parallelism: heads and ``wo_a`` groups (contiguous head blocks) are split over TP ranks; ``wq_b`` and
    ``wo_a`` are ``ColumnParallelLinear``, ``wo_b`` is ``RowParallelLinear`` (it all-reduces); ``attn_sink`` is the
    rank's head slice. Everything before the heads (``wq_a``, ``wkv``, the compressor, the indexer) is replicated;
    the shared KV enters the head-local region through ``copy_to_tensor_model_parallel_region`` so its gradient is
    summed over ranks.
    """

    def __init__(
        self,
        config: V4Config,
        layer_number: int,
        *,
        compress_ratio: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        init_std: float = DEFAULT_INIT_STD,
        activations: ActivationPlan | None = None,
    ) -> None:
        tp_group, tp_size, tp_rank = resolve_tp_group(tp_group)
        super().__init__(
            config=megatron_parallel_config(config, params_dtype=params_dtype, tensor_model_parallel_size=tp_size)
        )
        self.v4 = config
        self.layer_number = layer_number
        ratio = config.compress_ratios[layer_number] if compress_ratio is None else int(compress_ratio)
        _check_layout(config, layer_number, ratio, tp_size)
        heads, groups = config.num_heads, config.o_groups
        self.compress_ratio = ratio
        self.activations = activations or ActivationPlan()
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.head_dim = config.head_dim
        self.num_heads_local = heads // tp_size
        self.groups_local = groups // tp_size
        self.o_lora_rank = config.o_lora_rank
        self.window = config.window_size
        self.eps = config.rms_norm_eps
        self.scaling = config.head_dim**-0.5

        d, q_rank, hd = config.hidden_size, config.q_lora_rank, config.head_dim
        mp = self.config
        # wq_b (by heads) and wo_a (by output groups) split their outputs over TP alike
        column = partial(
            tensor_parallel.ColumnParallelLinear,
            config=mp,
            init_method=normal_init(init_std),
            bias=False,
            gather_output=False,
            tp_group=tp_group,
        )
        self.wq_a = ReplicatedLinear(d, q_rank, params_dtype=params_dtype, init_std=init_std)
        self.q_norm = RMSNorm(q_rank, self.eps, params_dtype=params_dtype)
        self.wq_b = column(q_rank, heads * hd)
        self.wkv = ReplicatedLinear(d, hd, params_dtype=params_dtype, init_std=init_std)
        self.kv_norm = RMSNorm(hd, self.eps, params_dtype=params_dtype)
        self.wo_a = column(heads * hd // groups, groups * config.o_lora_rank)
        self.wo_b = tensor_parallel.RowParallelLinear(
            groups * config.o_lora_rank,
            d,
            config=mp,
            init_method=normal_init(init_std),
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads_local, dtype=torch.float32))
        tensor_parallel.set_tensor_model_parallel_attributes(self.attn_sink, is_parallel=True, dim=0, stride=1)
        kw = {"eps": self.eps, "params_dtype": params_dtype, "init_std": init_std}
        self.compressor = Compressor(d, hd, ratio, overlap=ratio == INDEXER_RATIO, **kw) if ratio > 0 else None
        self.indexer = Indexer(config, params_dtype=params_dtype, init_std=init_std) if ratio == INDEXER_RATIO else None
        place_on_init_device(self)

    def _positions(self, position_ids: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise AttentionInputError(
                f"layer {self.layer_number}: position_ids must be an integer tensor, got {position_ids.dtype}"
            )
        shape = tuple(position_ids.shape)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len or position_ids.shape[0] not in (1, batch):
            raise AttentionInputError(
                f"layer {self.layer_number}: position_ids has shape {shape}, expected "
                f"[{seq_len}] or [{batch}, {seq_len}] for hidden_states [B={batch}, S={seq_len}, d]"
            )
        return position_ids

    def _window_hidden(self, q0: int, q1: int, k0: int, device: torch.device) -> torch.Tensor:
        """``[1, 1, q1-q0, q1-k0]`` (True = hidden): the causal sliding window of queries ``[q0, q1)`` over raw
        keys ``[k0, q1)``, by sequence index."""
        i = torch.arange(q0, q1, device=device).view(-1, 1)
        j = torch.arange(k0, q1, device=device).view(1, -1)
        return ((j > i) | (j <= i - self.window)).view(1, 1, q1 - q0, q1 - k0)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Softmax attention with the per-head sink in the denominator: ``q [B,H,Sq,D]``, shared ``kv [B,1,Sk,D]``,
        ``hidden`` broadcastable to ``[B,H,Sq,Sk]`` -> ``[B,H,Sq,D]``."""
        batch, heads, sq, hd = q.shape
        keys = kv.expand(batch, heads, kv.shape[2], hd).reshape(batch, heads, kv.shape[2], hd)
        logits = torch.matmul(q, keys.transpose(2, 3)) * self.scaling
        logits = logits.masked_fill(hidden, float("-inf"))
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(batch, -1, sq, -1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)  # sink dropped
        return torch.matmul(probs, keys)

    def _attend_by_query_blocks(
        self, q: torch.Tensor, kv: torch.Tensor, entry_hidden: torch.Tensor | None, seq_len: int
    ) -> torch.Tensor:
        """:meth:`_attend` per block of queries over its window band of raw keys plus every compressed entry.

        A key outside the band is hidden from every query of the block, and a hidden key adds exactly zero to the
        softmax, so each row equals the eager one (up to summation order)."""
        entries = kv[:, :, seq_len:]
        block = self.activations.attention_query_block
        checkpointed = self.activations.selective("core_attn")
        outs = []
        for q0 in range(0, seq_len, block):
            q1 = min(seq_len, q0 + block)
            k0 = max(0, q0 - self.window + 1)
            hidden = self._window_hidden(q0, q1, k0, q.device)
            keys = kv[:, :, k0:q1]
            if entry_hidden is not None:
                keys = torch.cat([keys, entries], dim=2)
                band = entry_hidden[:, q0:q1].unsqueeze(1)
                hidden = torch.cat([hidden.expand(band.shape[0], 1, -1, -1), band], dim=-1)
            outs.append(recompute(checkpointed, self._attend, q[:, :, q0:q1], keys, hidden))
        return torch.cat(outs, dim=2)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``hidden_states [B, S, d]``, ``position_ids [S] | [B, S]`` -> ``[B, S, d]`` (all-reduced over TP)."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.v4.hidden_size:
            raise AttentionInputError(
                f"layer {self.layer_number}: hidden_states must be [B, S, {self.v4.hidden_size}] (batch first), "
                f"got {tuple(hidden_states.shape)}"
            )
        x = hidden_states
        batch, seq_len, _ = x.shape
        heads, hd = self.num_heads_local, self.head_dim
        positions = self._positions(position_ids, batch, seq_len)
        inv_freq = rope_inv_freq(self.v4, compressed=self.compress_ratio > 0, device=x.device)
        cos, sin = rope_cos_sin(inv_freq, positions, x.dtype)  # [B|1, S, rd/2]
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads of [B, H, S, D]

        qr = self.q_norm(self.wq_a(x))  # [B, S, Q]; also feeds the indexer
        q, _ = self.wq_b(qr)
        q = unweighted_rms_norm(q.view(batch, seq_len, heads, hd).transpose(1, 2), self.eps)
        q = apply_interleaved_rope(q, cos_h, sin_h)  # [B, H, S, D]

        kv = self.kv_norm(self.wkv(x)).view(batch, seq_len, 1, hd).transpose(1, 2)
        kv = apply_interleaved_rope(kv, cos_h, sin_h)  # [B, 1, S, D]

        entry_hidden = None  # [B|1, S, W] (True = hidden) over the compressed entries
        if self.compressor is not None:
            entries = self.compressor(x, inv_freq)  # [B, W, D]
            n_entries = entries.shape[1]
            if self.indexer is not None:
                picks = self.indexer(x, qr, positions, inv_freq)  # [B, S, k], -1 = no pick
                valid = picks >= 0
                slots = torch.where(valid, picks, torch.full_like(picks, n_entries))
                shown = torch.zeros((batch, seq_len, n_entries + 1), dtype=torch.bool, device=x.device)
                shown.scatter_(-1, slots, True)
                entry_hidden = ~shown[..., :n_entries]
            else:
                visible_entries = (positions + 1) // self.compress_ratio  # [B|1, S]
                entry_hidden = torch.arange(n_entries, device=x.device).view(1, 1, -1) >= visible_entries.unsqueeze(-1)
            kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
        if self.tp_size > 1:
            kv = tensor_parallel.copy_to_tensor_model_parallel_region(kv, group=self.tp_group)

        if self.activations.uses_chunked_attention(seq_len):
            out = self._attend_by_query_blocks(q, kv, entry_hidden, seq_len)
        else:
            hidden = self._window_hidden(0, seq_len, 0, x.device)
            if entry_hidden is not None:
                hidden = torch.cat([hidden.expand(entry_hidden.shape[0], 1, -1, -1), entry_hidden.unsqueeze(1)], -1)
            out = recompute(self.activations.selective("core_attn"), self._attend, q, kv, hidden)
        out = out.transpose(1, 2).contiguous()  # [B, S, H, D]
        out = apply_interleaved_rope(out.transpose(1, 2), cos_h, sin_h, inverse=True).transpose(1, 2)

        grouped = out.reshape(batch, seq_len, self.groups_local, -1)
        z = grouped_wo_a(self.wo_a, grouped, groups=self.groups_local, group_out=self.o_lora_rank).flatten(2)
        output, _ = self.wo_b(z)
        return output
