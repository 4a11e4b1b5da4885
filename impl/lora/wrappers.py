"""LoRA on the native DeepSeek-V4 graph with Megatron-Bridge's real ``LoRA`` transform.

Megatron-Bridge does not handle three things of this graph, added here: replicated linears, the grouped ``wo_a``,
which only :func:`apply_grouped_wo_a` may run, and exclusions next to ``target_modules``. Each is described on
:class:`DeepseekV4LoRA`."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
from megatron.bridge.peft.lora import LoRA
from megatron.bridge.peft.lora_layers import LinearAdapter, LoRALinear, LoRATopKRouter
from megatron.bridge.peft.utils import ParallelLinearAdapter
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from impl.compat.megatron_bridge import adapter_enabled
from impl.errors import GroupedLoRAError, MultiLoRAUnsupportedError, TargetError
from impl.lora.targets import bridge_pattern_matches, qualify_exclusions, qualify_targets
from impl.native.norm import ReplicatedLinear
from impl.vocabulary import TARGET_TABLE

__all__ = [
    "DeepseekV4LoRA",
    "LoraHandle",
    "MTP_POLICIES",
    "MtpPolicy",
    "apply_grouped_wo_a",
    "apply_lora",
    "make_lora_pre_wrap_hook",
]

#: native leaves of the grouped (block-diagonal) targets, from the target table
GROUPED_LEAVES = frozenset(row.native for row in TARGET_TABLE.main if row.grouped)
_LORA_ABLE = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, nn.Linear)
_ALREADY_ADAPTED = (AdapterWrapper, LinearAdapter, LoRATopKRouter)


# --------------------------------------------------------------------------------------------- grouped wo_a


class _GatherRowsAcrossTP(torch.autograd.Function):
    """All-gather a TP-row-sharded weight; backward sums every rank's gradient and keeps this rank's rows.

    Each TP rank applies the *full* ``lora_A`` to its own groups, so a shard's gradient is the sum over ranks
    (a reduce-scatter, written as all-reduce + slice because gloo has no reduce-scatter).
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.rows = shard.shape[0]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def _full_lora_a(adapter: ParallelLinearAdapter) -> torch.Tensor:
    weight = adapter.linear_in.weight
    # the group that splits lora_A's rows is its own layer's (Bridge 0.4's adapter has no tp_group of its own)
    group = getattr(adapter.linear_in, "tp_group", None) or getattr(adapter, "tp_group", None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return weight
    return _GatherRowsAcrossTP.apply(weight, group)


def _grouped_name(module: nn.Module, name: str | None) -> str:
    if name:
        return name
    adapter = getattr(module, "adapter", None)
    return (
        getattr(adapter, "base_linear_name", None)
        or getattr(module, "dsv4_name", None)
        or "|".join(sorted(GROUPED_LEAVES))
    )


def apply_grouped_wo_a(
    module: nn.Module, x_grouped: torch.Tensor, *, groups: int, group_out: int, name: str | None = None
) -> torch.Tensor:
    """Grouped ``wo_a``: ``z[..., g, :] = x[..., g, :] @ (W_g + s * (B @ A)_g)^T`` -> ``[..., groups, group_out]``.

    ``module`` is the plain ``ColumnParallelLinear`` or its LoRA wrapper; ``groups`` is the number of groups on
    this TP rank and ``W_g``/``(B@A)_g`` are rows ``[g*R, (g+1)*R)``. The delta is computed per group
    (``A`` on each group's input, then that group's slice of ``B``); the ``[G, G, R]`` cross terms never exist.
    Layouts are checked before any arithmetic (:class:`GroupedLoRAError`).
    """
    base = module.to_wrap if isinstance(module, AdapterWrapper) else module
    label = _grouped_name(module, name)
    weight = base.weight
    if weight.ndim != 2 or weight.shape[0] != groups * group_out:
        raise GroupedLoRAError(
            f"{label}: grouped weight has shape {tuple(weight.shape)}, expected [groups*group_out, in] = "
            f"[{groups}*{group_out}={groups * group_out}, in] for the local groups; check o_groups/o_lora_rank "
            "and the tensor-parallel split of wo_a"
        )
    per_group_in = weight.shape[1]
    if tuple(x_grouped.shape[-2:]) != (groups, per_group_in):
        raise GroupedLoRAError(
            f"{label}: grouped input has trailing shape {tuple(x_grouped.shape[-2:])}, expected "
            f"(groups={groups}, H*D/G={per_group_in}); reshape the attention output to [..., groups, H*D/G]"
        )
    adapter = getattr(module, "adapter", None) if isinstance(module, AdapterWrapper) else None
    if adapter is not None:
        a_in = adapter.linear_in.weight.shape[1]
        b_out = adapter.linear_out.weight.shape[0]
        if a_in != per_group_in or b_out != groups * group_out:
            raise GroupedLoRAError(
                f"{label}: LoRA output mismatch: lora_A takes {a_in} inputs (need H*D/G={per_group_in}) and "
                f"lora_B gives {b_out} local outputs (need groups*group_out={groups}*{group_out}="
                f"{groups * group_out}); the adapter was not built for this grouped wo_a"
            )

    out = torch.einsum("...gd,grd->...gr", x_grouped, weight.view(groups, group_out, per_group_in))
    if adapter is None or not adapter_enabled(module):
        return out

    h = adapter.dropout(x_grouped) if adapter.dropout_position == "pre" else x_grouped
    h = adapter.activation(torch.matmul(h, _full_lora_a(adapter).t()))  # [..., G, r]
    lora_b = adapter.linear_out.weight.view(groups, group_out, -1)  # this rank's groups' rows of B
    delta = torch.einsum("...gr,gor->...go", h, lora_b)
    if adapter.dropout_position == "post":
        delta = adapter.dropout(delta)
    return out + delta * (adapter.alpha / adapter.dim)


# ------------------------------------------------------------------------------------------------ wrappers


class GroupedLoRALinear(LoRALinear):
    """LoRA wrapper of the grouped ``wo_a``; only :func:`apply_grouped_wo_a` may run it."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        raise GroupedLoRAError(
            f"{self.adapter.base_linear_name}: grouped wo_a cannot run as a dense linear (that would give each "
            "group all G*R outputs); call impl.lora.wrappers.apply_grouped_wo_a(module, x_grouped, groups=, group_out=)"
        )

    def grouped_forward(self, x_grouped: torch.Tensor, *, groups: int, group_out: int) -> torch.Tensor:
        """The hook the native attention calls on a wrapped ``wo_a``: the grouped product with this delta."""
        return apply_grouped_wo_a(self, x_grouped, groups=groups, group_out=group_out)


class ReplicatedLoRALinear(LoRALinear):
    """LoRA around a :class:`ReplicatedLinear`; keeps its plain-tensor call contract (``y = x W^T + s B A x``)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.to_wrap(x)
        if not adapter_enabled(self):
            return out
        return out + self.adapter(x.contiguous()).reshape(out.shape)


def _replicated_adapter_config(weight: torch.Tensor) -> ModelParallelConfig:
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        # CPU init draws from the CPU generator, seeded alike on every TP rank, so the replicas start equal;
        # the adapter is then moved to the base weight's device.
        use_cpu_initialization=True,
        params_dtype=weight.dtype,
        gradient_accumulation_fusion=False,
    )


@dataclass
class DeepseekV4LoRA(LoRA):
    """Megatron-Bridge ``LoRA`` that also wraps replicated linears and the grouped ``wo_a``.

    Matched modules that are not linears (norms, whole attention blocks hit by a broad wildcard) are left alone
    so that ``*.layers.0.*`` means "every linear of layer 0".

    Three things Megatron-Bridge 0.6.2 does not do for this graph, and how they are added here:

    * **Replicated linears** (``wq_a``, ``wkv``, indexer and compressor projections) are plain modules, not TE
      ``TELinear``; ``get_adapter_attributes_from_linear`` raises for them. They get the adapter Bridge gives a
      duplicated ``TELinear``: ``ParallelLinearAdapter(base_linear_is_parallel=False)``.
    * **Grouped ``wo_a``** (``docs/reference/v4_architecture.md`` §8.3): the base is a ``ColumnParallelLinear`` used
      block-diagonally per group. The adapter keeps PEFT's flattened shapes (``A [r, H*D/G]``, ``B [G*R, r]``);
      :func:`apply_grouped_wo_a` adds ``(B@A)_g`` only to group ``g``. Its dense ``forward`` refuses to run
      (:class:`GroupedLoRALinear`).
    * **Exclusions**: Bridge asserts ``exclude_modules`` is empty whenever ``target_modules`` is set, so
      exclusions are subtracted here and Bridge receives the exact (regex-escaped) full names that remain.
    """

    def _walk_model(self, model: Any, func: Callable[..., nn.Module]) -> None:
        """Bridge's walk asks ``inspect.signature(func)`` again at every module it visits (three walks a call,
        hundreds of thousands of modules on a full-size graph: most of the time LoRA took there). The same
        function goes in, with its signature computed once (docs/performance.md)."""
        signature = inspect.signature(func)

        def once(*args: Any, **kwargs: Any) -> nn.Module:
            return func(*args, **kwargs)

        once.__signature__ = signature  # type: ignore[attr-defined]
        super()._walk_model(model, once)

    def transform(self, module: nn.Module, name: str | None = None, prefix: str | None = None) -> nn.Module:
        if isinstance(module, (LoRALinear, *_ALREADY_ADAPTED)) or not isinstance(module, _LORA_ABLE):
            return module
        if isinstance(module, ReplicatedLinear):
            if (ans := self.match(module, name, prefix)) is None:
                return module
            weight = module.weight
            adapter = ParallelLinearAdapter(
                weight.shape[1],
                weight.shape[0],
                self.dim,
                base_linear_name=ans[1],
                activation="identity",
                column_init_method=self.lora_A_init_method,
                row_init_method=self.lora_B_init_method,
                input_is_parallel=False,
                dropout=self.dropout,
                dropout_position=self.dropout_position,
                model_parallel_config=_replicated_adapter_config(weight),
                alpha=self.alpha,
                base_linear_is_parallel=False,  # what Bridge gives a duplicated TELinear
                disable_tensor_parallel_comm=False,
                disable_sequence_parallel_comm=True,
            )
            return ReplicatedLoRALinear(module, adapter.to(device=weight.device))
        wrapped = super().transform(module, name, prefix)
        if isinstance(module, ColumnParallelLinear) and name in GROUPED_LEAVES and type(wrapped) is LoRALinear:
            return GroupedLoRALinear(wrapped.to_wrap, wrapped.adapter)
        return wrapped


# -------------------------------------------------------------------------------------------- application


def lora_able_module_names(chunk: nn.Module) -> list[str]:
    """Full names (global layer numbers, as ``named_modules`` gives them) of the modules LoRA can wrap."""
    return [n for n, m in chunk.named_modules() if n and isinstance(m, _LORA_ABLE)]


def _bridge_walk_names(chunk: nn.Module) -> dict[int, str]:
    """``id(module)`` -> the dotted name Megatron-Bridge's PEFT walk gives it: ``ModuleList`` children by position
    (``walk_utils``), so on a later pipeline stage ``decoder.layers.2`` is ``decoder.layers.0`` there."""
    out: dict[int, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        out[id(module)] = path
        children = enumerate(module) if isinstance(module, nn.ModuleList) else module.named_children()
        for key, child in children:
            visit(child, f"{path}.{key}" if path else str(key))

    visit(chunk, "")
    return out


def _exact_walk_targets(chunk: nn.Module, meant: Sequence[str]) -> list[str]:
    """Bridge refuses ``exclude_modules`` next to ``target_modules``, and its walk names a stage's layers 0, 1, ...
    (not their global numbers): the exact walk names of the modules meant, as ONE Bridge target pattern, an
    alternation. Bridge tries each pattern on each module of its walk in Python, compiling as it goes: one pattern
    per name cost seconds on a full-size graph, where one alternation is one match per module
    (docs/performance.md)."""
    walk, modules = _bridge_walk_names(chunk), dict(chunk.named_modules())
    names = [re.escape(walk[id(modules[n])]) for n in meant]
    return [f"(?:{'|'.join(names)})"] if names else []


def _on_any_stage(flags: list[bool]) -> list[bool]:
    """``flags`` OR-ed over the pipeline group (every stage runs the hook while building, so all agree)."""
    if (
        dist.is_initialized()
        and parallel_state.model_parallel_is_initialized()
        and parallel_state.get_pipeline_model_parallel_world_size() > 1
        and flags
    ):
        # A target may live only on another pipeline stage (e.g. the indexer on ratio-4 layers). The flags travel
        # as objects: torch puts those on the backend's device (the current GPU under NCCL, which refuses CPU
        # tensors), so this works under gloo and NCCL alike.
        group = parallel_state.get_pipeline_model_parallel_group()
        stages: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(stages, flags, group=group)
        flags = [any(column) for column in zip(*stages, strict=True)]
    return flags


def _matches_anywhere(patterns: Sequence[str], names: Sequence[str]) -> list[bool]:
    # a target may live only on another pipeline stage (e.g. the indexer on ratio-4 layers, or one layer's wq_b)
    return _on_any_stage([any(bridge_pattern_matches(p, n) for n in names) for p in patterns])


def _check(entries: Sequence[str], qualified: Sequence[str], names: Sequence[str], *, kind: str) -> None:
    flags = _matches_anywhere(qualified, names)
    missing = [e for e, ok in zip(entries, flags, strict=True) if not ok]
    if missing:  # re-run the qualifier on the unmatched entries only, for its error message
        (qualify_targets if kind == "target" else qualify_exclusions)(missing, module_names=names)


def _as_list(value) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


@dataclass(frozen=True)
class MtpPolicy:
    """What the LoRA targets mean for the MTP layer (``mtp.layers.*``, built with ``include_mtp=True``)."""

    name: str
    wraps_mtp: bool
    why: str


#: ``exclude`` (default): the targets never reach the MTP layer. The manual pipeline trains through the main loss
#: only, so MTP adapters would never update, and neither transformers nor SGLang can load MTP adapters.
#: ``include``: the MTP attention is wrapped too (train it through an MTP loss; export it in the official dialect,
#: or export with ``mtp='exclude'`` elsewhere).
MTP_POLICIES: dict[str, MtpPolicy] = {
    p.name: p
    for p in (
        MtpPolicy("exclude", False, "MTP is not trained by the main loss and transformers/SGLang cannot load it"),
        MtpPolicy("include", True, "the caller trains the MTP layer through its own loss"),
    )
}
MTP_PREFIX = "mtp."


def _mtp_policy(mtp: str) -> MtpPolicy:
    if mtp not in MTP_POLICIES:
        raise TargetError(f"mtp={mtp!r}: choose one of {sorted(MTP_POLICIES)} (what LoRA does with the MTP layer)")
    return MTP_POLICIES[mtp]


@dataclass
class LoraHandle:
    """What :func:`apply_lora` / the pre-wrap hook did."""

    lora: DeepseekV4LoRA
    targets: list[str]  # qualified
    exclude: list[str]  # qualified
    wrapped: list[list[str]] = field(default_factory=list)  # per chunk, full module names
    mtp: MtpPolicy = MTP_POLICIES["exclude"]

    @property
    def params_to_save(self) -> set[str]:
        return self.lora.params_to_save


def _wrap_chunk(lora, c: int, chunk: nn.Module, names, q_targets, q_exclude, policy) -> list[str]:
    """LoRA on exactly the modules of ``chunk`` the qualified targets select and nothing excludes (the rest frozen);
    returns their names, checked against what Megatron-Bridge actually wrapped."""
    hits = [n for n in names if any(bridge_pattern_matches(p, n) for p in q_targets)]
    meant = [
        n
        for n in hits
        if not any(bridge_pattern_matches(p, n) for p in q_exclude)
        and (policy.wraps_mtp or not n.startswith(MTP_PREFIX))
    ]
    lora.target_modules = _exact_walk_targets(chunk, meant)
    if meant:
        lora(chunk, training=True)
    else:
        lora.freeze_model(chunk, training=True)
    done = [n for n, m in chunk.named_modules() if isinstance(m, (AdapterWrapper, LinearAdapter))]
    if sorted(done) != sorted(meant):
        raise TargetError(f"chunk {c}: LoRA wrapped {sorted(done)} but the targets select {sorted(meant)}")
    return meant


def make_lora_pre_wrap_hook(
    *,
    targets,
    exclude=None,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    lora_A_init_method: str = "xavier",
    lora_B_init_method: str = "zero",
    adapter_names: Sequence[str] | None = None,
    mtp: str = "exclude",
) -> Callable[[list[nn.Module]], list[nn.Module]]:
    """A Megatron-Bridge pre-wrap hook (before DDP): qualify, apply ``LoRA(training=True)``, record params to save.

    ``mtp`` names a row of :data:`MTP_POLICIES` (default ``exclude``: nothing under ``mtp.`` is wrapped).
    The returned callable carries ``.handle`` (a :class:`LoraHandle`) once it has run.
    """
    policy = _mtp_policy(mtp)
    if adapter_names is not None and len(list(adapter_names)) > 1:
        raise MultiLoRAUnsupportedError(
            f"DeepSeek-V4 native construction does not support Multi-LoRA (adapters {list(adapter_names)}); "
            "train one adapter per run"
        )
    raw_targets, raw_exclude = _as_list(targets), _as_list(exclude)
    if not raw_targets:
        raise TargetError(
            f"no LoRA targets given; name them explicitly, e.g. {list(TARGET_TABLE.main_names)} "
            "(exclusion-only selection is not supported on the native V4 graph)"
        )
    q_targets, q_exclude = qualify_targets(raw_targets), qualify_exclusions(raw_exclude)
    lora = DeepseekV4LoRA(
        target_modules=list(q_targets),
        dim=rank,
        alpha=alpha,
        dropout=dropout,
        lora_A_init_method=lora_A_init_method,
        lora_B_init_method=lora_B_init_method,
    )

    def hook(model_chunks):
        chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
        for c, chunk in enumerate(chunks):
            adapted = [n for n, m in chunk.named_modules() if isinstance(m, _ALREADY_ADAPTED)]
            if adapted:
                raise MultiLoRAUnsupportedError(
                    f"model chunk {c} already carries adapters ({', '.join(adapted[:4])}...); a second LoRA on "
                    "the native DeepSeek-V4 graph would be Multi-LoRA, which is not supported"
                )
        lora_able = [lora_able_module_names(chunk) for chunk in chunks]
        every = [n for names in lora_able for n in names]
        _check(raw_targets, q_targets, every, kind="target")
        all_names = [n for chunk in chunks for n, _ in chunk.named_modules() if n]
        _check(raw_exclude, q_exclude, all_names, kind="exclusion")

        wrapped: list[list[str]] = []
        for c, (chunk, names) in enumerate(zip(chunks, lora_able, strict=True)):
            wrapped.append(_wrap_chunk(lora, c, chunk, names, q_targets, q_exclude, policy))
        if not _on_any_stage([any(wrapped)])[0]:  # a stage may hold none; the model as a whole may not
            raise TargetError(
                f"the exclusions {raw_exclude} (and mtp={policy.name!r}) remove every module selected by the targets "
                f"{raw_targets}"
            )
        lora.target_modules = list(q_targets)
        lora.set_params_to_save(chunks)
        hook.handle = LoraHandle(
            lora=lora, targets=list(q_targets), exclude=list(q_exclude), wrapped=wrapped, mtp=policy
        )
        return chunks

    hook.handle = None
    hook.lora = lora
    return hook


def apply_lora(model_chunks, **options: Any) -> LoraHandle:
    """Apply LoRA to already-built chunks (the pre-wrap hook, run now); only adapter params stay trainable.

    ``options``: those of :func:`make_lora_pre_wrap_hook` (``targets``, ``rank`` and ``alpha`` required)."""
    hook = make_lora_pre_wrap_hook(**options)
    hook(model_chunks)
    return hook.handle
