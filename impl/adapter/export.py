"""Adapter-only portable export of a DeepSeek-V4 LoRA: fail-closed, collective, atomic.

:func:`export_adapter` runs the phases of :data:`impl.adapter.phases.EXPORT_PHASES` in order; after each one every
rank learns every rank's status (:class:`impl.adapter.exchange.StatusExchange`), and any failure is every rank's
same :class:`CollectiveExportError` with the destination rolled back. Files, marker, recovery: :mod:`impl.adapter.files`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from impl.adapter.build import AdapterState, BuildOptions
from impl.adapter.exchange import StatusExchange
from impl.adapter.files import COMPLETE_MARKER
from impl.adapter.phases import EXPORT_PHASES, ExportContext, after_commit, roll_back
from impl.errors import CollectiveExportError, ExportError

PhaseTable = Sequence[tuple[str, Callable[[ExportContext], None]]]


def _check_phases(phases: PhaseTable) -> None:
    names = [name for name, _ in phases]
    want = [name for name, _ in EXPORT_PHASES]
    if names != want:
        raise ExportError(
            f"phases {names}: the export protocol is {want} in this order; a phase may be wrapped, never dropped, "
            "added or reordered"
        )


def export_adapter(
    adapter_phase: Callable[[], AdapterState | Mapping[str, AdapterState] | None]
    | AdapterState
    | Mapping[str, AdapterState],
    out_dir: str | os.PathLike,
    *,
    writer_rank: int = 0,
    timeout_s: float = 300.0,
    phases: PhaseTable = EXPORT_PHASES,
    **options: Any,
) -> Path:
    """Collective adapter-only export to ``out_dir`` (a PEFT directory + ``.complete``); returns ``out_dir``.

    Call on EVERY rank (``torch.distributed`` if initialised, else world 1). ``adapter_phase`` is the gather:
    a callable run on every rank that returns the full adapter state on ``writer_rank`` (other ranks may return
    None), or the state itself. On any failure on any rank, every surviving rank raises the same
    :class:`CollectiveExportError` naming each failing rank, and ``out_dir`` is left exactly as it was.
    ``timeout_s`` bounds each phase's wait for peers (a missing status becomes ``rank R: no response within Ts in
    phase P (dead or hung)``); it must exceed the slowest phase. The input is an adapter state (full native LoRA
    tensors and hyper-parameters) however the model was built. A rank lost after the commit point is still
    reported, but the error says the new adapter WAS committed (a writer lost inside the commit leaves the new
    export or the old one, never a mix). ``phases``:
    :data:`EXPORT_PHASES` or a copy with phases wrapped (same names, same order). ``options``: how the state is
    published, the fields of :class:`impl.adapter.build.BuildOptions` (``dialect``, ``base_fingerprint``, ``mtp``...);
    ``fingerprint_base`` (a base directory) has the writer fingerprint the exported modules' base weights in the
    serialize phase, so a failure there, like one in ``adapter_phase``, is every rank's collective error.

    ``consumer`` (``"vllm"``, ``"sglang"``, ``"peft"`` or one engine of :data:`impl.adapter.consumers.CONSUMER_RULES`,
    at ``consumer_version``): the serialize phase judges every exported target by that consumer's rules and fails
    closed (the writer's :class:`impl.errors.ConsumerSupportError`, naming consumer, version, target and why,
    becomes the cause of the collective error; nothing is published) when one would not be applied, skipped or
    misrouted; ``allow_unapplied=True`` exports anyway and records those targets in the safetensors metadata
    ``dsv4_consumer``."""
    _check_phases(phases)
    ex = StatusExchange(timeout_s, topic="dsv4_export")
    if not 0 <= writer_rank < ex.world:
        raise ExportError(f"writer_rank={writer_rank} is outside the world of {ex.world} ranks")
    options = BuildOptions(**options)
    out = Path(os.path.abspath(out_dir))
    ctx = ExportContext(ex.rank, ex.world, ex.rank == writer_rank, out, adapter_phase, options)
    for phase, run in phases:
        cause: BaseException | None = None
        try:
            run(ctx)
            status = ""
        except Exception as exc:  # collected across ranks below, then re-raised identically everywhere
            cause = exc
            status = f"{type(exc).__name__}: {exc}"
        failures = ex.agree(phase, status)
        if failures:
            raise _failed(ctx, phase, failures, writer_rank, store_lost=ex.store_lost) from cause
    after_commit(ctx)
    return ctx.out_dir


def _writer_lost(failures: list[str], writer_rank: int) -> bool:
    return any(f.startswith(f"rank {writer_rank}: no response") for f in failures)


def _failed(
    ctx: ExportContext, phase: str, failures: list[str], writer_rank: int, *, store_lost: bool
) -> CollectiveExportError:
    """Clean up after ``phase`` failed somewhere and return the error every rank raises."""
    head = f"adapter export to {ctx.out_dir} failed in phase {phase}: " + "; ".join(failures) + ". "
    # Only the writer acts in the commit phase, so its own status says whether the commit point was passed.
    writer_named = any(f.startswith(f"rank {writer_rank}: ") for f in failures)
    if phase == "commit" and not writer_named:  # it committed; a peer lost after that cannot un-commit
        if store_lost and not ctx.writer:  # unless its status never reached this rank: it may be rolling back
            roll_back(ctx, recover=False)
            return CollectiveExportError(
                head + f"The group's store was lost with its host, so this rank cannot know whether the writer (rank "
                f"{writer_rank}) passed the commit point: the destination holds either the complete new adapter or "
                "the earlier export, never a mix; check its .complete (impl.validate_adapter_dir) before using it."
            )
        after_commit(ctx)
        return CollectiveExportError(
            head + f"The new adapter WAS committed (rank {writer_rank} passed the commit point and "
            f"{ctx.out_dir}/{COMPLETE_MARKER} certifies it); the rank(s) above were lost after that. Find out "
            "why; the export itself need not be re-run."
        )
    writer_lost = _writer_lost(failures, writer_rank)
    stand_in = min(r for r in range(ctx.world) if r != writer_rank) if ctx.world > 1 else None
    roll_back(ctx, recover=ctx.writer or (writer_lost and ctx.rank == stand_in))
    if phase == "commit" and writer_lost:  # before or after its rename: unknown
        return CollectiveExportError(
            head + f"The writer (rank {writer_rank}) stopped inside the commit, so the destination holds either "
            "the complete new adapter or the earlier export, never a mix; check its .complete "
            "(impl.validate_adapter_dir) before using it."
        )
    return CollectiveExportError(
        head + "Nothing was published and the destination is unchanged; fix the cause named above and re-run."
    )


__all__ = [
    "export_adapter",
]
