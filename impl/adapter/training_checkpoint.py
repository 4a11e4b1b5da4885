"""Training checkpoints of a LoRA run, layout-free: save at one TP / EP / PP layout, resume at any.

A checkpoint holds full tensors under the native global names, which is what makes it layout-free, and is published
as the export is (staging, fsync, atomic rename, ``.complete`` last) once every rank has agreed it has nothing to
report: a failure on any rank writes nothing. :func:`impl.adapter.resume.resume_training` reads it back.
"""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)
from impl.errors import TrainingCheckpointError

# isort: split

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save
from torch import nn

from impl.adapter.build import AdapterState, BuildOptions, all_finite, with_base_fingerprint
from impl.adapter.exchange import StatusExchange
from impl.adapter.files import publish_files
from impl.adapter.gather import adapter_parameters, gather_full, merge_stages

__all__ = [
    "CHECKPOINT_FORMAT",
    "save_training_checkpoint",
]

CHECKPOINT_FORMAT = "dsv4-lora-training"
ADAPTER, OPTIMIZER, RNG, STATE = "adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"
CHECKPOINT_FILES = (ADAPTER, OPTIMIZER, RNG, STATE)
MASTER = "master"


@dataclass(frozen=True)
class Slot:
    """One trained parameter: the live parameter, the tensor the optimizer steps (itself, or its fp32 master),
    and the torch optimizer holding its state."""

    param: nn.Parameter
    holder: torch.Tensor
    inner: torch.optim.Optimizer


def optimizer_slots(optimizer: Any) -> dict[int, Slot]:
    """``id(param)`` -> :class:`Slot` for every parameter ``optimizer`` trains: a torch optimizer, or
    :class:`impl.AdapterOptimizer` (whose fp32 masters are what its inner AdamW steps)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(optimizer, "masters"):
        pairs = zip(optimizer.params, optimizer.masters, strict=True)
    elif isinstance(optimizer, torch.optim.Optimizer):
        inner = optimizer
        pairs = ((p, p) for group in optimizer.param_groups for p in group["params"])
    else:
        raise TrainingCheckpointError(
            f"optimizer {type(optimizer).__name__}: a training checkpoint holds the state of a torch optimizer or "
            "impl.AdapterOptimizer"
        )
    return {id(p): Slot(p, holder, inner) for p, holder in pairs}


def current_layout() -> dict[str, int]:
    """This run's world and model-parallel sizes (what a checkpoint records and a resume compares)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not ps.model_parallel_is_initialized():
        return {"world": world, "tp": 1, "pp": 1, "ep": 1}
    return {
        "world": world,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }


def _slots_for(chunks: Sequence[nn.Module], optimizer: Any) -> tuple[list[tuple[str, Slot]], list[str]]:
    """(name, slot) of every LoRA parameter of this rank, and what does not fit (a trained non-LoRA parameter, a
    LoRA parameter the optimizer does not train)."""
    slots = optimizer_slots(optimizer)
    named = [(name, p) for name, p, _ in adapter_parameters(chunks)]
    problems = [f"{name}: the optimizer does not train this LoRA parameter" for name, p in named if id(p) not in slots]
    lora = {id(p) for _, p in named}
    problems += [
        f"a parameter of shape {list(s.param.shape)} is trained but is no LoRA parameter of the model"
        for key, s in slots.items()
        if key not in lora
    ]
    return [(name, slots[id(p)]) for name, p in named if id(p) in slots], problems


def _state_keys(slots: Sequence[tuple[str, Slot]]) -> list[str]:
    keys = {tuple(sorted(s.inner.state.get(s.holder, {}))) for _, s in slots}
    if len(keys) > 1:
        raise TrainingCheckpointError(f"optimizer state keys differ between parameters: {sorted(keys)}")
    return list(keys.pop()) if keys else []


def _gather_optimizer(chunks: Sequence[nn.Module], slots: list[tuple[str, Slot]]) -> dict[str, torch.Tensor]:
    """Masters and state tensors laid out like their parameter, TP-gathered; scalars (Adam's ``step``) as they are
    (collective over the TP group: call on every rank)."""
    by_param = {id(s.param): s for _, s in slots}
    out: dict[str, torch.Tensor] = {}
    if any(s.holder is not s.param for _, s in slots):
        masters = gather_full(chunks, lambda p: by_param[id(p)].holder)
        out |= {f"{MASTER}/{n}": t for n, t in masters.items()}
    for key in _state_keys(slots):
        value = lambda p, k=key: by_param[id(p)].inner.state[by_param[id(p)].holder][k]  # noqa: E731
        if all(value(s.param).dim() == 0 for _, s in slots):
            out |= {f"{key}/{n}": value(s.param).detach().to("cpu").clone() for n, s in slots}
        else:
            out |= {f"{key}/{n}": t for n, t in gather_full(chunks, value).items()}
    return out


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        for name, t in get_cuda_rng_tracker().get_states().items():
            states[f"tracker.{name}"] = t.detach().to("cpu").clone()
    except Exception:  # no tracker initialised in this run: nothing of it to restore either
        pass
    return states


def _all_rng() -> dict[str, torch.Tensor]:
    mine = _rng_states()
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {f"rank{r}/{k}": t for r, states in enumerate(everyone) for k, t in states.items()}


def _param_groups(slots: list[tuple[str, Slot]]) -> list[dict[str, Any]]:
    inner = slots[0][1].inner if slots else None
    groups = [] if inner is None else inner.param_groups
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in groups]


@dataclass
class _Payload:
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    groups: list[dict[str, Any]]


def _checked(payload: _Payload) -> None:
    """Fail closed on an adapter that must not be resumed from: empty, or any tensor not finite."""
    if not payload.adapter:
        raise TrainingCheckpointError("the model holds no LoRA parameters: apply LoRA before checkpointing")
    for file, tensors in ((ADAPTER, payload.adapter), (OPTIMIZER, payload.optimizer)):
        for name, t in tensors.items():
            if t.is_floating_point() and not all_finite(t):
                raise TrainingCheckpointError(f"{file}: {name} holds NaN or Inf; not checkpointing a diverged run")


def _files(payload: _Payload, state: dict[str, Any]) -> dict[str, bytes]:
    return {
        ADAPTER: save(payload.adapter, metadata={"format": "pt"}),
        OPTIMIZER: save(payload.optimizer, metadata={"format": "pt"}),
        RNG: save(payload.rng, metadata={"format": "pt"}),
        STATE: (json.dumps(state, indent=2, sort_keys=True) + "\n").encode(),
    }


def _trainer_state(payload: _Payload, step: int, lora: Any, base: Any, extra: Mapping[str, Any] | None) -> dict:
    fingerprint = None
    if base is not None:
        state = AdapterState(payload.adapter, r=int(lora.dim), alpha=float(lora.alpha))
        fingerprint = with_base_fingerprint(state, BuildOptions(fingerprint_base=base)).base_fingerprint
    return {
        "format": CHECKPOINT_FORMAT,
        "version": 1,
        "step": int(step),
        "layout": current_layout(),
        "lora": {"r": int(lora.dim), "alpha": float(lora.alpha), "dropout": float(getattr(lora, "dropout", 0.0))},
        "param_groups": payload.groups,
        "base_fingerprint": fingerprint,
        "extra": dict(extra or {}),
    }


def _run_phase(ex: StatusExchange, name: str, out: Path, run: Callable[[], Any]) -> Any:
    """Run ``run`` on this rank, then agree with every rank; the same error everywhere on any failure."""
    return ex.run(
        name,
        run,
        lambda failures: TrainingCheckpointError(
            f"training checkpoint to {out} failed in phase {name}: {failures}. Nothing was written; {out} is as it was."
        ),
    )


def save_training_checkpoint(
    model_chunks: Sequence[nn.Module],
    optimizer: Any,
    out_dir: str | os.PathLike,
    *,
    step: int,
    handle: Any,
    base: str | os.PathLike | None = None,
    extra: Mapping[str, Any] | None = None,
    writer_rank: int = 0,
    timeout_s: float = 300.0,
) -> Path:
    """Collective: write the training checkpoint of this run at ``step`` to ``out_dir``; returns it.

    Call on every rank, after an optimizer step. ``handle``: the LoRA handle (its ``r``/``alpha``). ``base``: the
    base checkpoint directory; the adapted base weights' fingerprint is recorded so a resume on another base is
    refused. ``extra``: JSON-able caller state (a data-loader position). Any failure on any rank raises the same
    :class:`TrainingCheckpointError` everywhere and writes nothing, leaving an earlier checkpoint at that path as it
    was. The files:

    * ``adapter.safetensors``: the LoRA parameters, in their own dtype;
    * ``optimizer.safetensors``: ``master/<name>`` (fp32 masters of non-fp32 parameters,
      :class:`impl.AdapterOptimizer`), ``<state key>/<name>`` for every optimizer state tensor (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``);
    * ``rng.safetensors``: ``rank<r>/<generator>``, every rank's random generator states;
    * ``trainer_state.json``: the step, the layout it was saved at, LoRA hyper-parameters, the optimizer's
      hyper-parameters per group, the base fingerprint of the adapted base weights, the caller's ``extra``."""
    out = Path(os.path.abspath(out_dir))
    ex = StatusExchange(timeout_s, topic="dsv4_checkpoint")
    lora = getattr(handle, "lora", handle)

    def prepare() -> list[tuple[str, Slot]]:
        slots, problems = _slots_for(list(model_chunks), optimizer)
        if problems:
            raise TrainingCheckpointError("; ".join(problems))
        if not 0 <= writer_rank < ex.world:
            raise TrainingCheckpointError(f"writer_rank={writer_rank} is outside the world of {ex.world} ranks")
        return slots

    slots = _run_phase(ex, "prepare", out, prepare)

    def gather() -> _Payload:
        chunks = list(model_chunks)
        merged = merge_stages({**gather_full(chunks), **_gather_optimizer(chunks, slots)})
        optim = {n: t for n, t in merged.items() if "/" in n}
        adapter = {n: t for n, t in merged.items() if "/" not in n}
        return _Payload(adapter, optim, _all_rng(), _param_groups(slots))

    payload = _run_phase(ex, "gather", out, gather)

    def write() -> None:
        if ex.rank == writer_rank:
            _checked(payload)
            files = _files(payload, _trainer_state(payload, step, lora, base, extra))
            publish_files(out, files, None, kind=CHECKPOINT_FORMAT)

    _run_phase(ex, "write", out, write)
    return out
