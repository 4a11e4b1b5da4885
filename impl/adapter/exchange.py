"""Every rank's status after a phase of a collective operation, agreed over the default group's key-value store.

The export, the training checkpoint, resume, the import and the publication to rollout call
:meth:`StatusExchange.agree` (or :meth:`StatusExchange.run`) after each phase: a failure anywhere is every rank's
same failure, a dead or hung peer is named by the deadline instead of stranding the others at a barrier, and the
process group stays usable."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

__all__ = ["StatusExchange", "join_failures"]


def topic_name(prefix: str) -> str:
    """What the operation is called in a message (``dsv4_export/3/`` -> ``export``)."""
    return prefix.split("/", 1)[0].removeprefix("dsv4_").replace("_", " ")


#: Before blocking in the store's own wait, poll this long: a peer with nothing to do in a phase answers within a
#: millisecond or two, and FileStore's wait (the file:// rendezvous) looks only every 10 ms.
_POLL_S, _POLL_EVERY_S = 0.02, 0.001


class StatusExchange:
    """Per-phase status exchange over the default group's store, with a deadline; never poisons the group.

    A phase costs a rank a handful of store operations (post, wait for all, read all, check for an abort), not two
    per peer; a world of one rank needs no store at all."""

    _seq = 0

    def __init__(self, timeout_s: float, *, topic: str):
        StatusExchange._seq += 1
        self.timeout_s = timeout_s
        dist = torch.distributed
        self.rank, self.world, self.store = 0, 1, None
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if self.world > 1:
                self.store = distributed_c10d._get_default_store()
        self.prefix = f"{topic}/{StatusExchange._seq}/"
        #: the store's host (rank 0) was lost in an exchange: no peer's status can reach this rank any more
        self.store_lost = False

    def agree(self, phase: str, status: str) -> list[str]:
        """Post this rank's status for ``phase`` (``""``: ok, else ``"ExcType: message"``), read every peer's with a
        deadline of ``timeout_s``, and return every rank's failure (same list on every rank): ``"rank N: <its
        status>"``, a peer that never posted named dead or hung, the store's host (rank 0) named when the store itself
        is gone (then with this rank's own failure, and :attr:`store_lost` set), and on a rank whose peers all posted
        ok, that a peer which timed out earlier aborted the operation."""
        if self.store is None:
            return [f"rank {self.rank}: {status}"] if status else []
        keys = [f"{self.prefix}{phase}/{r}" for r in range(self.world)]
        try:
            self.store.set(keys[self.rank], status or "ok")
            missing = self._missing(keys)
            present = [r for r in range(self.world) if r not in missing]
            values = dict(zip(present, self.store.multi_get([keys[r] for r in present]), strict=True))
            failures = [
                f"rank {r}: no response within {self.timeout_s:g}s in phase {phase} (dead or hung)"
                if r in missing
                else f"rank {r}: {values[r].decode()}"
                for r in range(self.world)
                if r in missing or values[r] != b"ok"
            ]
            if failures:
                self.store.set(f"{self.prefix}abort", "1")
            elif self.store.check([f"{self.prefix}abort"]):
                failures.append(f"{topic_name(self.prefix)} aborted by a peer that timed out before phase {phase}")
            return failures
        except Exception:  # the store itself is gone: the rank hosting it (rank 0 by default) died
            self.store_lost = True
            lost = [f"rank 0: no response within {self.timeout_s:g}s in phase {phase} (store host dead or hung)"]
            # this rank's own failure still counts: its caller must not take the peers' silence for its success
            return lost + ([f"rank {self.rank}: {status}"] if status else [])

    def run(self, phase: str, fn: Callable[[], Any], error: Callable[[str], Exception]) -> Any:
        """Run ``fn`` on this rank, then :meth:`agree` on the outcome; ``fn``'s result, or on any rank's failure the
        caller's ``error(every rank's failures in one line)`` raised on every rank alike (chained to this rank's
        own exception, if it had one)."""
        result, status, cause = None, "", None
        try:
            result = fn()
        except Exception as exc:  # agreed across ranks, then raised identically everywhere
            status, cause = f"{type(exc).__name__}: {exc}", exc
        failures = self.agree(phase, status)
        if failures:
            raise error(join_failures(failures)) from cause
        return result

    def _missing(self, keys: list[str]) -> set[int]:
        """Wait until every rank has posted or the deadline passed; the ranks that never posted."""
        deadline = time.monotonic() + self.timeout_s
        poll_until = min(deadline, time.monotonic() + _POLL_S)
        while time.monotonic() < poll_until:
            if self.store.check(keys):
                return set()
            time.sleep(_POLL_EVERY_S)
        try:
            self.store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            return set()
        except Exception:  # store timeout: some rank never posted; find which
            return {r for r, key in enumerate(keys) if not self.store.check([key])}


def join_failures(failures: list[str]) -> str:
    """``agree``'s failures in one line, ranks with the same message named together (``ranks 0, 1: ...``)."""
    by_message: dict[str, list[str]] = {}
    for failure in failures:
        head, sep, message = failure.partition(": ")
        if not (sep and head.startswith("rank ")):
            head, message = "", failure
        by_message.setdefault(message, []).append(head.removeprefix("rank "))
    parts = []
    for message, ranks in by_message.items():
        named = [r for r in ranks if r]
        who = f"rank {named[0]}" if len(named) == 1 else f"ranks {', '.join(named)}" if named else ""
        parts.append(f"{who}: {message}" if who else message)
    return "; ".join(parts)
