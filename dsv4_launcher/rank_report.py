"""What one rank did (:class:`RankResult`) and the torchrun-shaped report over all ranks (:func:`format_report`).

Shared by the launcher (``dsv4_launcher.launch``: the command line raises :class:`~dsv4_launcher.launch.LaunchError` with
this report) and the test suites' runner, which adds declared expectations on top::

    2/4 ranks failed in _rank_export (world_size=4, timeout=30s)
    root cause: rank 1 ExportError: ...
    rank 0: did not finish within 30s
    rank 2: killed by SIGKILL (exit -9)
    rank 3: RuntimeError: [gloo/...] Connection closed by peer ... (collective error, likely collateral)

followed by each failed rank's traceback or stack dump.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXITED",
    "NOT_STARTED",
    "OK",
    "RAISED",
    "SIGNALLED",
    "TERMINATED",
    "TIMEOUT",
    "RankResult",
    "format_report",
    "is_collective_error",
    "qualified_name",
    "root_cause",
]

# RankResult.outcome values
OK, RAISED, SIGNALLED, EXITED, TIMEOUT, TERMINATED, NOT_STARTED = (
    "ok",
    "raised",
    "signalled",
    "exited",
    "timeout",
    "terminated",
    "not_started",
)

_COLLECTIVE_EXC_TYPES = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}
_COLLECTIVE_MESSAGE = re.compile(r"gloo/|nccl|Connection closed by peer|Connection reset by peer|Timed out waiting")


def qualified_name(cls: type) -> str:
    """``module.qualname`` of a class: how results name exception classes across processes."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class RankResult:
    """What one rank did. ``payload`` is ``fn``'s return value when ``ok``; the rest describes a failure."""

    rank: int
    ok: bool
    exc_type: str | None = None  # class name of the exception fn raised ("ExportError")
    message: str = ""
    traceback: str = ""
    payload: Any = None
    exc_mro: tuple[str, ...] = ()  # "module.qualname" of the exception class and its bases, for matching
    outcome: str = OK  # ok | raised | signalled | exited | timeout | terminated | not_started
    exitcode: int | None = None  # process exit code; negative: killed by that signal
    stack_dump: str = ""  # faulthandler output (SIGUSR1 before termination, or a fatal signal)
    pid: int | None = None
    finished_at: float | None = None  # time.time() when the failure was observed

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankResult:
        """The result of a rank whose function raised ``exc`` (any ``BaseException``: pytest.skip, SystemExit)."""
        return cls(
            rank=rank,
            ok=False,
            exc_type=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            exc_mro=tuple(qualified_name(c) for c in type(exc).__mro__),
            outcome=RAISED,
            pid=os.getpid(),
            finished_at=time.time(),
        )

    def summary(self) -> str:
        """One line: ``ExportError: ...``, ``killed by SIGKILL (exit -9)``, ``did not finish within 30s``."""
        if self.outcome in (OK, RAISED):
            if self.ok:
                return "ok"
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            text = f"{self.exc_type}: {first[:300]}" if first else str(self.exc_type)
            return text + (" (collective error, likely collateral)" if is_collective_error(self) else "")
        return self.message


def is_collective_error(result: RankResult) -> bool:
    """A rank that raised because a peer's collective went away (gloo/NCCL errors, collective timeouts)."""
    return result.outcome == RAISED and (
        result.exc_type in _COLLECTIVE_EXC_TYPES or _COLLECTIVE_MESSAGE.search(result.message) is not None
    )


def root_cause(failures: Sequence[RankResult]) -> RankResult | None:
    """The failure to blame: a rank's own error beats a hang, which beats the collective errors of its peers."""
    primary = [r for r in failures if r.outcome in (RAISED, SIGNALLED, EXITED) and not is_collective_error(r)]
    hung = [r for r in failures if r.outcome in (TIMEOUT, TERMINATED)]
    pool = primary or hung or list(failures)
    return min(pool, key=lambda r: (r.finished_at or float("inf"), r.rank)) if pool else None


def format_report(results: Sequence[RankResult], *, fn_name: str, world_size: int, timeout_s: float) -> str:
    """The torchrun-shaped report: header, root cause, one line per other failed rank, then the details."""
    failures = [r for r in results if not r.ok]
    root = root_cause(failures)
    lines = [
        f"{len(failures)}/{world_size} ranks failed in {fn_name} (world_size={world_size}, timeout={timeout_s:g}s)"
    ]
    if root is not None:
        lines.append(f"root cause: rank {root.rank} {root.summary()}")
    lines += [f"rank {r.rank}: {r.summary()}" for r in failures if r is not root]
    ok = [str(r.rank) for r in results if r.ok]
    if ok:
        lines.append(f"ok: rank {', '.join(ok)}")
    for r in ([root] if root else []) + [r for r in failures if r is not root]:
        if r.traceback:
            lines += ["", f"--- rank {r.rank} traceback ---", r.traceback.rstrip()]
        if r.stack_dump:
            lines += ["", f"--- rank {r.rank} stack dump (faulthandler) ---", r.stack_dump.rstrip()]
    return "\n".join(lines)
