"""Spawn ``nproc`` gloo ranks for one function, rendezvous them, and reap every one: the process mechanics of
:func:`dsv4_launcher.launch.launch_ranks`.

The calling process is a dispatcher, never a rank. For one call::

    parent                                       rank r (fresh interpreter, "spawn" context)
    ------                                       -------------------------------------------
    mkdtemp(): FileStore path + stack files
    start nproc processes  ------------------->   setsid() (own process group), parent-death signal
                                                 env: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, extras
                                                 faulthandler -> rank<r>.stack (fatal signals and SIGUSR1)
                                                 preload, import fn's module, unpickle case
                           <-------------------  ("ready", pid)
    all ready -> before_go() (the caller's),
    then "go" to every rank  ---------------->   init_process_group(gloo|nccl, file://, timeout=timeout_s/2), barrier
                                                 payload = fn(rank, world_size, case)
    progress.show shows them  <-------------    ("say", line) / ("step", (what, seconds)): fn's progress lines
                           <-------------------  ("result", RankResult)   (also when fn raised anything)
                                                 destroy_process_group() (success only), os._exit

A rank inherits the parent's descriptors 1 and 2 (under ``dsv4-lora``: its log, see :mod:`impl.cli.output`), so
what a rank wants a person to see travels over its pipe. The "go" handshake keeps import time out of both clocks (the rendezvous timeout and ``timeout_s``, which counts
from "go"); imports have their own limit, ``startup_timeout_s``. The parent waits on every rank's pipe and
process sentinel at once. The first failure (an exception, a death by signal, an exit without a result) starts a
grace period so peers can report their own errors; when it or ``timeout_s`` runs out, every rank still running is
asked for a stack dump (SIGUSR1), then gets SIGTERM, then SIGKILL, each sent to the rank's whole process group.
The parent joins every rank before returning: no orphans.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from dsv4_launcher import progress
from dsv4_launcher.rank_report import EXITED, NOT_STARTED, SIGNALLED, TERMINATED, TIMEOUT, RankResult

__all__ = [
    "START_METHODS",
    "Preload",
    "collective_timeout_s",
    "resolve_backend",
    "set_collective_timeout_s",
    "spawn_ranks",
    "start_up",
]

#: a module to import (by name) or a module-level callable to call in each rank before the clock starts
Preload = str | Callable[[], object]

_DUMP_WAIT_S = 1.0  # time for faulthandler to write a stack dump after SIGUSR1
_TERM_WAIT_S = 1.0  # SIGTERM -> SIGKILL
_EXIT_WAIT_S = 5.0  # a rank that reported its result but has not exited yet

#: how ranks start (see spawn_ranks)
START_METHODS = ("spawn", "forkserver")

_COLLECTIVE_TIMEOUT_S: float | None = None  # this rank's default-group timeout, once a launcher set it


def collective_timeout_s() -> float | None:
    """Inside a rank: the default process group's collective timeout the launcher chose (None: not launched here).
    Megatron's groups should get the same one instead of their 30-minute default."""
    return _COLLECTIVE_TIMEOUT_S


def set_collective_timeout_s(seconds: float) -> None:
    global _COLLECTIVE_TIMEOUT_S
    _COLLECTIVE_TIMEOUT_S = seconds


# --------------------------------------------------------------------------------------------- rank side


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    fn_module: str
    fn_qualname: str
    case: bytes
    init_method: str
    backend: str | None  # "gloo", "nccl" (one GPU per rank: LOCAL_RANK), None: nccl where CUDA is present
    pg_timeout_s: float
    env: dict[str, str]
    stack_file: str
    parent_pid: int
    preload: tuple[Preload, ...]
    start_method: str


def resolve_function(module: str, qualname: str) -> Callable[..., Any]:
    """The module-level function ``module.qualname`` (how ranks find what to run)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_backend() -> str:
    """NCCL where CUDA is present, else gloo (decided in the rank: the launcher need not import torch)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def _die_with_parent(parent_pid: int | None) -> None:
    # The rank lives in its own session, so a dying parent would not take it along: ask the kernel to. (A forked
    # rank's parent is the fork server, which exits when the launcher does: parent_pid None.)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _match_thread_count(env: Mapping[str, str]) -> None:
    """Torch may be imported before this launch's ``OMP_NUM_THREADS`` is in the environment: in the fork server, or
    in a spawned rank while it unpickles its spec (a preload named by a function imports that function's module,
    and torch with it, before :func:`_rank_main` runs). Apply it then; a later import of torch reads it itself."""
    threads = env.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        torch.set_num_threads(int(threads))


def start_up(preload: Sequence[Preload]) -> None:
    """Import each module / call each callable of ``preload``, in order."""
    for item in preload:
        if isinstance(item, str):
            importlib.import_module(item)
        else:
            item()


def _start_up(spec: _RankSpec) -> tuple[Callable[..., Any], Any]:
    """Everything slow before the clock: preloads, fn's module, the case."""
    start_up(spec.preload)
    return resolve_function(spec.fn_module, spec.fn_qualname), pickle.loads(spec.case)


def _join_world(spec: _RankSpec) -> None:
    import torch.distributed as dist

    set_collective_timeout_s(spec.pg_timeout_s)
    backend = spec.backend or resolve_backend()
    if backend == "nccl":
        import torch

        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.pg_timeout_s),
    )
    # Gloo's full mesh is connected when every rank has returned from init, not when this one has: a fast rank
    # whose fn returns at once would otherwise exit and close its sockets under a peer still connecting.
    dist.barrier()


def _rank_main(spec: _RankSpec, conn: Connection) -> None:
    os.setsid()
    forked = spec.start_method == "forkserver"
    _die_with_parent(None if forked else spec.parent_pid)
    os.environ.update(spec.env)
    _match_thread_count(spec.env)
    stack_file = open(spec.stack_file, "w")  # stays open for the process's lifetime: faulthandler writes to it
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    started = False
    try:
        fn, case = _start_up(spec)
        conn.send(("ready", os.getpid()))
        if conn.recv() != "go":
            os._exit(1)
        started = True
        progress.forward_to(conn.send)  # the rank's descriptors may point at a log: progress lines go to the launcher
        _join_world(spec)
        result = RankResult(rank=spec.rank, ok=True, payload=fn(spec.rank, spec.world_size, case), pid=os.getpid())
    except EOFError:  # the parent closed the pipe: it is tearing the run down
        os._exit(1)
    except BaseException as exc:  # pytest.skip/fail, SystemExit, KeyboardInterrupt: failures to report too
        result = RankResult.from_exception(spec.rank, exc)
    try:
        conn.send(("result", result))
    except Exception as exc:  # an unpicklable payload is fn's bug: report it as this rank's failure
        conn.send(("result", RankResult.from_exception(spec.rank, exc)))
    progress.forward_to(None)
    conn.close()
    if result.ok and started:
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass  # the parent has the result; a failed teardown must not turn it into a failure
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result.ok else 1)


# ------------------------------------------------------------------------------------------- parent side


class _Rank:
    def __init__(self, rank: int, proc: Any, conn: Connection, stack_file: str):
        self.rank = rank
        self.proc = proc
        self.conn: Connection | None = conn
        self.stack_file = stack_file
        self.ready = False
        self.result: RankResult | None = None
        self.exitcode: int | None = None
        self.reaped_elsewhere = False  # multiprocessing reaped it: its pid may be reused, never signal it
        self.observed_at: float | None = None
        self.dump = ""  # faulthandler output, read before the temp dir goes

    @property
    def failed(self) -> bool:
        if self.result is not None:
            return not self.result.ok
        return self.exitcode is not None and self.conn is None

    def receive(self) -> None:
        assert self.conn is not None
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            return
        if kind == "ready":
            self.ready = True
        elif kind == "result":
            self.result = value
            self.close()
        else:
            progress.show((kind, value))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def poll_exit(self) -> None:
        # WNOWAIT leaves the rank a zombie, so its pid (= its process group id) cannot be reused before the
        # final killpg that also reaches anything the rank started. A forked rank is the fork server's child: the
        # server reaps it and reports its exit code through the sentinel; from then on it is never signalled.
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            self.reaped_elsewhere = True
            self.exitcode = self.proc.exitcode
            self.observed_at = time.time()
            return
        if info is None:
            return
        self.exitcode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self.observed_at = time.time()

    def signal(self, sig: int) -> None:
        if self.reaped_elsewhere:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the rank and everything it started
        except ProcessLookupError:  # not yet in its own session (or already gone)
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def final_result(self, stopped: tuple[str, str] | None) -> RankResult:
        if self.result is not None:
            return replace(self.result, exitcode=self.exitcode)
        common = {"rank": self.rank, "ok": False, "exitcode": self.exitcode, "pid": self.proc.pid}
        common |= {"finished_at": self.observed_at, "stack_dump": self.dump}
        if stopped is not None:
            return RankResult(**common, outcome=stopped[0], message=stopped[1])
        if self.exitcode is not None and self.exitcode < 0:
            message = f"killed by {_signal_name(self.exitcode)} (exit {self.exitcode})"
            return RankResult(**common, outcome=SIGNALLED, message=message)
        message = f"exited with code {self.exitcode} before reporting a result"
        return RankResult(**common, outcome=EXITED, message=message)


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _wait_for_dumps(ranks: list[_Rank]) -> None:
    """Give faulthandler time to write: until every file is non-empty and stopped growing, or _DUMP_WAIT_S."""
    end, sizes = time.monotonic() + _DUMP_WAIT_S, None
    while time.monotonic() < end:
        time.sleep(0.05)
        now = [os.path.getsize(r.stack_file) if os.path.exists(r.stack_file) else 0 for r in ranks]
        if all(now) and now == sizes:
            return
        sizes = now


@dataclass
class _Clock:
    """The moments that bound the wait: startup deadline, then run deadline from "go"; grace after a failure."""

    deadline: float
    grace_s: float
    go_at: float | None = None
    first_failure_at: float | None = None
    all_reported_at: float | None = None

    def limit(self) -> float:
        limit = self.deadline
        if self.first_failure_at is not None:  # a failure during startup stops everything at once
            limit = min(limit, self.first_failure_at + (self.grace_s if self.go_at is not None else 0.0))
        if self.all_reported_at is not None:
            limit = min(limit, self.all_reported_at + _EXIT_WAIT_S)
        return limit


def _start(spec_for: Callable[[int], _RankSpec], nproc: int, ranks: list[_Rank]) -> None:
    """Start every rank, appending each to ``ranks`` at once (so a failed start still reaps the others)."""
    for rank in range(nproc):
        spec = spec_for(rank)
        ctx = multiprocessing.get_context(spec.start_method)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_rank_main, args=(spec, child_conn), name=f"rank{rank}", daemon=True)
        proc.start()
        child_conn.close()
        ranks.append(_Rank(rank, proc, parent_conn, spec.stack_file))


def _supervise(ranks: list[_Rank], clock: _Clock, timeout_s: float, before_go: Callable[[], object] | None) -> None:
    """Wait on every pipe and sentinel until all ranks are done or the clock's limit passes; ``before_go`` runs
    once every rank is ready, before any starts (what it raises leaves here, and the ranks are reaped unstarted)."""
    while True:
        waitables: list[Any] = [r.conn for r in ranks if r.conn is not None]
        waitables += [r.proc.sentinel for r in ranks if r.exitcode is None]
        limit = clock.limit()
        if not waitables or time.monotonic() >= limit:
            return
        ready = wait(waitables, timeout=max(0.0, limit - time.monotonic()))
        for r in ranks:
            if r.conn is not None and r.conn in ready:
                r.receive()
            if r.exitcode is None and r.proc.sentinel in ready:
                r.poll_exit()
        if clock.go_at is None and all(r.ready for r in ranks) and not any(r.failed for r in ranks):
            if before_go is not None:
                before_go()
            for r in ranks:
                try:
                    r.conn.send("go")  # type: ignore[union-attr]  # every rank is ready: its pipe is open
                except (AttributeError, OSError):
                    pass  # it died meanwhile; its sentinel reports that next round
            clock.go_at = time.monotonic()
            clock.deadline = clock.go_at + timeout_s
        if clock.first_failure_at is None and any(r.failed for r in ranks):
            clock.first_failure_at = time.monotonic()
        if clock.all_reported_at is None and all(r.result is not None for r in ranks):
            clock.all_reported_at = time.monotonic()


def _stop_reasons(ranks: list[_Rank], clock: _Clock, timeout_s: float, startup_s: float) -> dict[int, tuple[str, str]]:
    """rank -> (outcome, message) for every rank still running, which the runner now has to stop."""
    first = min((r for r in ranks if r.failed), key=lambda r: r.rank, default=None)
    stopped: dict[int, tuple[str, str]] = {}
    for r in ranks:
        if r.result is not None or r.exitcode is not None:
            continue
        if clock.go_at is None and first is not None:
            stopped[r.rank] = (NOT_STARTED, f"stopped before start: rank {first.rank} failed during startup")
        elif clock.go_at is None:
            stopped[r.rank] = (TIMEOUT, f"did not start within {startup_s:g}s (imports, unpickling)")
        elif first is not None:
            stopped[r.rank] = (TERMINATED, f"still running {clock.grace_s:g}s after a peer failed; terminated")
        else:
            stopped[r.rank] = (TIMEOUT, f"did not finish within {timeout_s:g}s")
    return stopped


def spawn_ranks(
    fn_module: str,
    fn_qualname: str,
    case: bytes,
    *,
    nproc: int,
    timeout_s: float,
    startup_timeout_s: float,
    grace_s: float,
    env: Mapping[str, str],
    preload: tuple[Preload, ...],
    backend: str | None = "gloo",
    before_go: Callable[[], object] | None = None,
    start_method: str = "spawn",
) -> list[RankResult]:
    """Run ``fn_module.fn_qualname(rank, nproc, pickle.loads(case))`` on ``nproc`` new ranks.

    ``start_method``: ``"spawn"`` (a fresh interpreter per rank) or ``"forkserver"`` (forked from multiprocessing's
    fork server, which the caller has started with its preload: imports paid once per server, not per rank; gloo
    only, since CUDA does not survive a fork)."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if start_method == "forkserver" and backend != "gloo":
        raise ValueError(f"forked ranks run gloo only (CUDA does not survive a fork), got backend={backend!r}")
    tmp = tempfile.mkdtemp(prefix="multirank-")
    world_env = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}

    def spec_for(rank: int) -> _RankSpec:
        return _RankSpec(
            rank=rank,
            world_size=nproc,
            fn_module=fn_module,
            fn_qualname=fn_qualname,
            case=case,
            init_method=f"file://{tmp}/filestore",
            backend=backend,
            pg_timeout_s=timeout_s / 2,
            env={"RANK": str(rank), "LOCAL_RANK": str(rank), **world_env, **env},
            stack_file=os.path.join(tmp, f"rank{rank}.stack"),
            parent_pid=os.getpid(),
            preload=preload,
            start_method=start_method,
        )

    ranks: list[_Rank] = []
    stopped: dict[int, tuple[str, str]] = {}
    try:
        _start(spec_for, nproc, ranks)
        clock = _Clock(deadline=time.monotonic() + startup_timeout_s, grace_s=grace_s)
        _supervise(ranks, clock, timeout_s, before_go)
        stopped = _stop_reasons(ranks, clock, timeout_s, startup_timeout_s)
        unfinished = [r for r in ranks if r.rank in stopped]
        for r in unfinished:
            r.signal(signal.SIGUSR1)
        if unfinished:
            _wait_for_dumps(unfinished)
    finally:
        _reap(ranks)
        shutil.rmtree(tmp, ignore_errors=True)
    return [r.final_result(stopped.get(r.rank)) for r in ranks]


def _reap(ranks: list[_Rank]) -> None:
    """SIGTERM what is still running, then SIGKILL every rank's process group, then join: no orphans."""
    for r in ranks:
        r.dump = _read(r.stack_file)
    alive = [r for r in ranks if r.exitcode is None]
    for r in alive:
        r.signal(signal.SIGTERM)
    end = time.monotonic() + _TERM_WAIT_S
    for r in alive:
        while r.exitcode is None and time.monotonic() < end:
            if wait([r.proc.sentinel], timeout=max(0.0, end - time.monotonic())):
                r.poll_exit()
    for r in ranks:
        r.signal(signal.SIGKILL)  # also reaches grandchildren of ranks that exited on their own
    for r in ranks:
        r.proc.join()
        if r.exitcode is None:
            r.exitcode = r.proc.exitcode
        r.close()
