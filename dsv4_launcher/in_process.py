"""One rank of a launched world: the in-process side of :func:`dsv4_launcher.launch.launch_ranks`.

Under torchrun (or inside a spawned rank that calls the launcher again) this process is one rank: ``fn`` runs here
on the default process group. Each call talks to its peers through the default group's key-value store, never
through a process group a failed peer could leave hanging. Keys live under ``dsv4-launch/<call number>/``:

* ``agree<r>``: what rank r is about to run (``fn`` and the caller's ``agree`` value: the suites pass the test id
  and a digest of their collection). Every rank compares them before ``fn`` runs, so ranks that drifted apart
  (another test, another collection) all raise :class:`RanksDisagree` at once instead of meeting in a stranger's
  collective. ``case`` is not compared: it may rightly differ (each rank's private checkpoint copy).
* ``result<r>``: rank r's :class:`RankResult`, posted the moment ``fn`` returns or raises. It is the failure notice
  that peers still inside ``fn`` see, and the exchange every rank gathers afterwards.

While ``fn`` runs, a watcher thread polls the peers' results. The first failed peer is printed on this rank at once
(``[rank 0] rank 1: ValueError: ...``), so every rank names the root cause even while it waits in a collective.
On NCCL, whose collectives never return when a peer is gone (the watchdog takes the process down instead), the
watcher then aborts the process groups after ``grace_s`` so the collective raises, this rank reports in-band, and the
next call joins a fresh default group. A gloo collective raises by itself at the group's timeout.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dsv4_launcher.errors import BackendMismatch, RanksDisagree
from dsv4_launcher.rank_report import TIMEOUT, RankResult
from dsv4_launcher.spawn import Preload, collective_timeout_s, set_collective_timeout_s, start_up

__all__ = ["BackendMismatch", "InProcessCall", "RanksDisagree", "gather_in_world", "run_in_process"]

_POLL_S = 0.2
_RESULTS_MARGIN_S = 30.0  # a rank waits this long past the run's timeout for its peers' results
_CALLS = [0]  # calls made in this process; every rank of a world makes the same sequence


@dataclass(frozen=True)
class InProcessCall:
    """One in-process call: this rank of the launched world, what to run, and its clocks."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # the default group's backend when this call has to create it: "gloo" or "nccl"
    timeout_s: float
    startup_timeout_s: float
    grace_s: float
    agree: object = None  # a value every rank must pass identically (the suites: the test id)
    preload: tuple[Preload, ...] = ()  # imported / called after joining, before the call's clock starts
    before_go: Callable[[], object] | None = None  # run on every rank once all have preloaded, before ``fn``


def _join(call: InProcessCall) -> float | None:
    """Join (or create) the default group with this call's collective timeout; the timeout it had before."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # by the caller or an earlier call: it must be the backend this call asks for
        have = dist.get_backend()
        if have != call.backend:
            raise BackendMismatch(
                f"this call asks for the {call.backend} backend, but the default process group of this rank is "
                f"{have}: a GPU run must not fall back to gloo (or a CPU run to NCCL) within one launched world"
            )
        # The group outlives calls (one per test under torchrun): each call's collectives get its own timeout.
        before = collective_timeout_s()
        _set_collective_timeouts(call.timeout_s / 2)
        return before
    if call.backend == "nccl":
        torch.cuda.set_device(call.local_rank)
    dist.init_process_group(
        call.backend,
        init_method="env://",
        rank=call.rank,
        world_size=call.world_size,
        timeout=timedelta(seconds=call.timeout_s / 2),
    )
    set_collective_timeout_s(call.timeout_s / 2)
    return None


def _set_collective_timeouts(seconds: float) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout  # no public setter for a live group

    if dist.is_initialized():
        _set_pg_timeout(timedelta(seconds=seconds))
    set_collective_timeout_s(seconds)


def _store(number: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store  # no public getter for the group's store

    return dist.PrefixStore(f"dsv4-launch/{number}/", _get_default_store())


def _agree(store: Any, call: InProcessCall, what: tuple[str, str]) -> None:
    """Post what this rank is about to run; raise :class:`RanksDisagree` unless every rank posts the same."""
    store.set(f"agree{call.rank}", pickle.dumps(what))
    keys = [f"agree{r}" for r in range(call.world_size)]
    try:
        store.wait(keys, timedelta(seconds=call.startup_timeout_s))
    except Exception as exc:  # the store's timeout error: name who never arrived
        missing = [r for r in range(call.world_size) if not store.check([f"agree{r}"])]
        raise RanksDisagree(
            f"rank {call.rank} ran {what[0]} ({what[1]}); ranks {missing} did not reach the same call within "
            f"{call.startup_timeout_s:g}s: the ranks collected or ordered their work differently ({exc})"
        ) from None
    posted = {r: pickle.loads(store.get(f"agree{r}")) for r in range(call.world_size)}
    differ = {r: w for r, w in posted.items() if w != what}
    if differ:
        lines = [f"rank {r}: {w[0]} ({w[1]})" for r, w in sorted(posted.items())]
        raise RanksDisagree("the ranks are not running the same call:\n  " + "\n  ".join(lines))


class _Watcher(threading.Thread):
    """Polls the peers' results while ``fn`` runs: prints the first failed peer, aborts NCCL after the grace."""

    def __init__(self, store: Any, call: InProcessCall):
        super().__init__(name=f"dsv4-watch-rank{call.rank}", daemon=True)
        self.store, self.call = store, call
        self.finished = threading.Event()
        self.peer_failure: RankResult | None = None

    def run(self) -> None:
        pending = [r for r in range(self.call.world_size) if r != self.call.rank]
        while pending and not self.finished.wait(_POLL_S):
            for peer in [p for p in pending if self.store.check([f"result{p}"])]:
                pending.remove(peer)
                result = pickle.loads(self.store.get(f"result{peer}"))
                if not result.ok:
                    self._on_peer_failure(result)
                    return

    def _on_peer_failure(self, result: RankResult) -> None:
        self.peer_failure = result
        print(f"[rank {self.call.rank}] rank {result.rank}: {result.summary()}", file=sys.stderr, flush=True)
        if self.call.backend == "nccl" and not self.finished.wait(self.call.grace_s):
            from torch.distributed.distributed_c10d import _abort_process_group  # NCCL only, experimental

            print(f"[rank {self.call.rank}] aborting the NCCL process groups", file=sys.stderr, flush=True)
            _abort_process_group()


def _gather(store: Any, call: InProcessCall, started: float) -> list[RankResult]:
    deadline = started + call.timeout_s + _RESULTS_MARGIN_S
    results = []
    for r in range(call.world_size):
        try:
            store.wait([f"result{r}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            results.append(pickle.loads(store.get(f"result{r}")))
        except Exception:  # the store's timeout error
            waited = deadline - started
            message = f"did not report a result within {waited:g}s"
            results.append(RankResult(rank=r, ok=False, outcome=TIMEOUT, message=message, finished_at=time.time()))
    if store.add("done", 1) == call.world_size:  # the last rank to read cleans up
        for r in range(call.world_size):
            for key in (f"agree{r}", f"result{r}"):
                store.delete_key(key)
        store.delete_key("done")
    return results


def run_in_process(fn: Callable[..., Any], case: bytes, call: InProcessCall) -> list[RankResult]:
    """``fn(rank, world_size, pickle.loads(case))`` on this rank; every rank's result, in rank order."""
    before = _join(call)
    _CALLS[0] += 1
    store = _store(_CALLS[0])
    start_up(call.preload)
    started = time.monotonic()
    watcher: _Watcher | None = None
    interrupted: BaseException | None = None
    try:
        _agree(store, call, (f"{fn.__module__}.{fn.__qualname__}", repr(call.agree)))
        watcher = _Watcher(store, call)
        watcher.start()
        if call.before_go is not None:  # after the agreement: a preload of one rank may write what it reads
            call.before_go()
        result = RankResult(rank=call.rank, ok=True, payload=fn(call.rank, call.world_size, pickle.loads(case)))
    except BaseException as exc:  # report it to the peers whatever its type; see KeyboardInterrupt below
        result = RankResult.from_exception(call.rank, exc)
        interrupted = exc if isinstance(exc, KeyboardInterrupt) else None
    if watcher is not None:
        watcher.finished.set()
    try:
        store.set(f"result{call.rank}", pickle.dumps(result))
    except Exception as exc:  # an unpicklable payload is fn's bug: report it as this rank's failure
        store.set(f"result{call.rank}", pickle.dumps(RankResult.from_exception(call.rank, exc)))
    results = _gather(store, call, started)
    if before is not None:  # the caller's group: give it back its own timeout
        _set_collective_timeouts(before)
    if interrupted is not None:  # this process is the pytest session too: Ctrl-C must still stop it
        raise interrupted
    return results


def gather_in_world(tag: str, value: object, *, rank: int, world_size: int, timeout_s: float) -> list[object] | None:
    """Every rank's ``value`` for ``tag`` (``None`` for a rank that did not post it within ``timeout_s``), through
    the default group's store; ``None`` when this process has no default group. Each tag is used once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(f"dsv4-gather/{tag}/", _get_default_store())
    store.set(f"v{rank}", pickle.dumps(value))
    deadline = time.monotonic() + timeout_s
    values: list[object] = []
    for r in range(world_size):
        try:
            store.wait([f"v{r}"], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            values.append(pickle.loads(store.get(f"v{r}")))
        except Exception:  # the store's timeout error
            values.append(None)
    return values
