"""Resume a LoRA run from a training checkpoint (:mod:`impl.adapter.training_checkpoint`), at any layout; refuse,
never start fresh.

Every rank checks the checkpoint before anything changes and the ranks agree on the outcome; only then does each
copy its slice into parameters, masters and optimizer state, the generators at the saved layout only
(:func:`resume_training` lists the checks; :class:`ResumeInfo` says what was restored)."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load
from torch import nn

from impl.adapter.build import all_finite
from impl.adapter.exchange import StatusExchange
from impl.adapter.files import COMPLETE_MARKER
from impl.adapter.fingerprint import FingerprintMismatchError, verify_fingerprint
from impl.adapter.scatter import load_full, model_adapter_names, scatter_problems
from impl.adapter.training_checkpoint import (
    ADAPTER,
    CHECKPOINT_FILES,
    CHECKPOINT_FORMAT,
    MASTER,
    OPTIMIZER,
    RNG,
    STATE,
    TrainingCheckpointError,
    _slots_for,
    current_layout,
)

__all__ = [
    "ResumeInfo",
    "latest_training_checkpoint",
    "read_training_checkpoint",
    "resume_training",
]


@dataclass(frozen=True)
class ResumeInfo:
    """What a resume restored: the step to continue after, both layouts, whether the generators were restored."""

    path: Path
    step: int
    saved_layout: dict[str, int]
    layout: dict[str, int]
    rng_restored: bool
    extra: dict[str, Any]


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A checkpoint's files, read and certified (marker, hashes, format, finiteness)."""

    path: Path
    state: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]


def _certified(path: Path) -> dict[str, bytes]:
    """The files ``.complete`` certifies, read once and checked against their sha256."""
    marker_file = path / COMPLETE_MARKER
    if not path.is_dir():
        raise TrainingCheckpointError(f"{path}: no training checkpoint there (not a directory); nothing resumed")
    if not marker_file.is_file():
        raise TrainingCheckpointError(
            f"{marker_file}: missing, so {path} is an interrupted or partial checkpoint; resume from an earlier one"
        )
    try:
        marker = json.loads(marker_file.read_text())
        files = dict(marker["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TrainingCheckpointError(f"{marker_file}: unreadable ({exc})") from None
    if marker.get("format") != CHECKPOINT_FORMAT:
        raise TrainingCheckpointError(
            f"{marker_file}: format {marker.get('format')!r}, not a training checkpoint ({CHECKPOINT_FORMAT}); an "
            "exported adapter is imported with impl.import_adapter, not resumed"
        )
    out: dict[str, bytes] = {}
    for name in CHECKPOINT_FILES:
        file = path / name
        if name not in files or not file.is_file():
            raise TrainingCheckpointError(f"{file}: missing from the checkpoint; resume from an earlier one")
        data = file.read_bytes()
        if hashlib.sha256(data).hexdigest() != files[name]:
            raise TrainingCheckpointError(f"{file}: its bytes are not the ones .complete certifies (torn or edited)")
        out[name] = data
    return out


def _tensors(path: Path, name: str, data: bytes) -> dict[str, torch.Tensor]:
    try:
        tensors = _load(path, name, data)
    except (SafetensorError, ValueError) as exc:
        raise TrainingCheckpointError(f"{path / name}: not a safetensors file ({exc})") from None
    for key, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise TrainingCheckpointError(f"{path / name}: {key} holds NaN or Inf; refusing to resume a diverged run")
    return tensors


def read_training_checkpoint(path: str | os.PathLike) -> TrainingCheckpoint:
    """Read and certify a training checkpoint directory (no model needed); :class:`TrainingCheckpointError`
    naming the file otherwise."""
    path = Path(path)
    raw = _certified(path)
    try:
        state = json.loads(raw[STATE])
    except ValueError as exc:
        raise TrainingCheckpointError(f"{path / STATE}: not JSON ({exc})") from None
    if state.get("format") != CHECKPOINT_FORMAT or not isinstance(state.get("step"), int):
        raise TrainingCheckpointError(f"{path / STATE}: not a {CHECKPOINT_FORMAT} trainer state with a step")
    adapter = _tensors(path, ADAPTER, raw[ADAPTER])
    if not adapter:
        raise TrainingCheckpointError(f"{path / ADAPTER}: holds no LoRA tensors (an empty adapter); nothing resumed")
    return TrainingCheckpoint(
        path, state, adapter, _tensors(path, OPTIMIZER, raw[OPTIMIZER]), _tensors(path, RNG, raw[RNG])
    )


def latest_training_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directly under ``root`` (by its saved step), skipping incomplete ones; None
    only when ``root`` holds no checkpoint at all (a fresh run). Checkpoints that all fail to read are an error,
    never a fresh start."""
    root = Path(root)
    candidates = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    steps, problems = {}, []
    for path in candidates:
        try:
            steps[path] = read_training_checkpoint(path).state["step"]
        except TrainingCheckpointError as exc:
            problems.append(str(exc))
    if steps:
        return max(steps, key=lambda p: (steps[p], p.name))
    if problems:
        raise TrainingCheckpointError(
            f"{root}: {len(problems)} checkpoint(s), none complete: " + "; ".join(problems[:3]) + ". Resume from "
            "a complete one, or start fresh by removing them."
        )
    return None


def _lora_problems(ckpt: TrainingCheckpoint, handle: Any) -> list[str]:
    if handle is None:
        return []
    lora = getattr(handle, "lora", handle)
    saved = ckpt.state.get("lora", {})
    have = {"r": int(lora.dim), "alpha": float(lora.alpha)}
    return [
        f"{ckpt.path / STATE}: LoRA {k}={saved.get(k)} saved, this model has {k}={v}"
        for k, v in have.items()
        if saved.get(k) != v
    ]


def _base_problems(ckpt: TrainingCheckpoint, base: Any) -> list[str]:
    if base is None:
        return []
    recorded = ckpt.state.get("base_fingerprint")
    if recorded is None:
        return [f"{ckpt.path / STATE}: records no base fingerprint, so the base cannot be checked; save with base=..."]
    try:
        verify_fingerprint(recorded, base)
    except FingerprintMismatchError as exc:
        return [f"{ckpt.path / STATE}: {exc}"]
    return []


def _optimizer_problems(ckpt: TrainingCheckpoint, slots: list, names: set[str]) -> list[str]:
    keys = sorted({k.split("/", 1)[0] for k in ckpt.optimizer} - {MASTER})
    want = {f"{k}/{n}" for k in keys for n in names}
    if any(s.holder is not s.param for _, s in slots) and keys:
        want |= {f"{MASTER}/{n}" for n in names}
    missing = sorted(want - set(ckpt.optimizer))
    groups = ckpt.state.get("param_groups", [])
    problems = [f"{ckpt.path / OPTIMIZER}: {n} is missing" for n in missing[:5]]
    if slots and len(groups) != len(slots[0][1].inner.param_groups):
        problems.append(f"{ckpt.path / STATE}: {len(groups)} optimizer parameter groups saved, this optimizer has "
                        f"{len(slots[0][1].inner.param_groups)}")  # fmt: skip
    return problems


def _restore_optimizer(chunks: Sequence[nn.Module], ckpt: TrainingCheckpoint, slots: list) -> None:
    by_param = {id(s.param): s for _, s in slots}
    keys = sorted({k.split("/", 1)[0] for k in ckpt.optimizer} - {MASTER})
    if f"{MASTER}/{slots[0][0]}" in ckpt.optimizer:
        load_full(chunks, {n.split("/", 1)[1]: t for n, t in ckpt.optimizer.items() if n.startswith(MASTER + "/")},
                  into=lambda p: by_param[id(p)].holder)  # fmt: skip
    for name, s in slots:
        state = s.inner.state[s.holder] = {}
        for key in keys:
            saved = ckpt.optimizer[f"{key}/{name}"]
            state[key] = saved.clone() if saved.dim() == 0 else torch.empty_like(s.holder, dtype=saved.dtype)
    for key in keys:
        full = {n.split("/", 1)[1]: t for n, t in ckpt.optimizer.items() if n.startswith(key + "/")}
        if next(iter(full.values())).dim() > 0:
            load_full(chunks, full, into=lambda p, k=key: by_param[id(p)].inner.state[by_param[id(p)].holder][k])
    for group, saved in zip(slots[0][1].inner.param_groups, ckpt.state.get("param_groups", []), strict=False):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})


def _restore_rng(ckpt: TrainingCheckpoint, rank: int) -> None:
    mine = {k.split("/", 1)[1]: t for k, t in ckpt.rng.items() if k.startswith(f"rank{rank}/")}
    torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
    tracker = {k.removeprefix("tracker."): t for k, t in mine.items() if k.startswith("tracker.")}
    if tracker:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(tracker)


def resume_training(
    model_chunks: Sequence[nn.Module],
    optimizer: Any,
    ckpt_dir: str | os.PathLike,
    *,
    handle: Any = None,
    base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    timeout_s: float = 300.0,
) -> ResumeInfo:
    """Collective: restore the LoRA parameters, masters, optimizer state (and, at the saved layout, the random
    generators) of ``ckpt_dir`` into this run; the next step is ``info.step + 1``.

    Call on every rank, after building the model and optimizer as for a fresh run. ``handle``: the LoRA handle,
    whose ``r``/``alpha`` must be the saved ones. ``base``: the base checkpoint, checked against the recorded
    fingerprint. Any problem on any rank raises the same :class:`TrainingCheckpointError` on every rank, naming
    the file, and changes nothing.

    Every rank reads the checkpoint itself (it lies on storage every rank sees, as the base does) and checks it
    before anything changes: the ``.complete`` marker and every file's sha256 (an interrupted or torn save), the
    format, a non-empty adapter, finite tensors of dtypes torch can load, the LoRA hyper-parameters and parameter
    names of this model (another target set), the base fingerprint (another base), the optimizer's state. The ranks
    agree on the outcome (:class:`impl.adapter.exchange.StatusExchange`); only when every rank found nothing wrong
    does each copy its slice of the full tensors into its parameters, masters and optimizer state
    (:mod:`impl.adapter.scatter`). The random generators are per rank: restored when the layout is the
    one saved, not at another (``rng_restored`` of the :class:`ResumeInfo` says which)."""
    path = Path(os.path.abspath(ckpt_dir))
    ex = StatusExchange(timeout_s, topic="dsv4_resume")
    chunks = list(model_chunks)
    names = model_adapter_names(chunks)  # collective: before anything that may fail on one rank only

    def check() -> tuple[TrainingCheckpoint, list]:
        ckpt = read_training_checkpoint(path)
        slots, problems = _slots_for(chunks, optimizer)
        problems += _lora_problems(ckpt, handle) + _base_problems(ckpt, base)
        problems += [f"{path / ADAPTER}: {p}" for p in scatter_problems(chunks, ckpt.adapter, names)]
        problems += _optimizer_problems(ckpt, slots, names)
        if problems:
            raise TrainingCheckpointError(f"{path} cannot be resumed into this run: " + "; ".join(problems))
        return ckpt, slots

    ckpt, slots = ex.run(
        "check",
        check,
        lambda failures: TrainingCheckpointError(
            f"resume from {path} refused: {failures}. Nothing was restored; the run has not started."
        ),
    )
    load_full(chunks, ckpt.adapter)
    _restore_optimizer(chunks, ckpt, slots)
    saved, layout = dict(ckpt.state["layout"]), current_layout()
    same = saved == layout
    if same:
        _restore_rng(ckpt, ex.rank)
    return ResumeInfo(path, ckpt.state["step"], saved, layout, same, dict(ckpt.state.get("extra", {})))


def _load(path: Path, name: str, data: bytes) -> dict[str, torch.Tensor]:
    """``load(data)``, with the one refusal it leaves untyped typed: a dtype the safetensors format has but torch's
    loader lacks (``F8_E8M0``, ``F4``, ``F6``) is a bare KeyError of the dtype there; here, the file and the tensors
    stored in it are named. Last in the module so the mutation campaign's earlier occurrences keep their numbers."""
    try:
        return load(data)
    except KeyError as exc:
        dtype = exc.args[0] if exc.args else None
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        tensors = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == dtype)
        raise TrainingCheckpointError(
            f"{path / name}: {', '.join(tensors) or 'a tensor'} stored as {dtype}, a dtype torch's safetensors loader "
            "cannot read; not a checkpoint the save wrote (resume from an earlier one)"
        ) from None
