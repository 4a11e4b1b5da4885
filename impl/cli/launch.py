"""The one rank launcher: run ``fn(rank, world_size, case)`` on N ranks, never hang, report every rank.

Used by the command line (``qualify``: :func:`run_on_ranks`, which raises :class:`LaunchError`) and by the test
suites' runner (``fixtures/multirank.py``, which judges :func:`launch_ranks`' results against declared
expectations).

* Plain process: ``nproc`` ranks are spawned (``impl.cli.spawn``): gloo (the command line: NCCL where CUDA is
  present) over a file store (no ports), a post-init barrier, a hard timeout with stack dumps, SIGTERM then SIGKILL to each rank's process group, every rank joined.
* Inside a launched world (``RANK``/``WORLD_SIZE`` set: torchrun, or a spawned rank calling this again): this
  process is one rank. ``fn`` runs here on the default process group (initialised with NCCL when CUDA is present,
  else gloo, unless someone did it before); the results travel over a dedicated gloo group whose timeout outlasts
  the default group's, so a rank whose function raised does not meet its peers inside their collective: they time
  out there, report, and every rank gets every result. There are no stack dumps or kills on that path.

Whatever ``fn`` raises (``BaseException``: also ``pytest.skip``/``pytest.fail``, ``SystemExit``) becomes that
rank's :class:`RankResult` instead of leaving its peers waiting.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from impl.cli.rank_report import (
    RAISED,
    SIGNALLED,
    TERMINATED,
    RankResult,
    format_report,
    is_collective_error,
    qualified_name,
    root_cause,
)
from impl.cli.spawn import Preload, collective_timeout_s, set_collective_timeout_s, spawn_ranks, start_up
from impl.errors import Dsv4Error

__all__ = [  # the outcome names and report helpers are re-exported for the suites' runner (fixtures/multirank.py)
    "GRACE_S",
    "RAISED",
    "SIGNALLED",
    "STARTUP_TIMEOUT_S",
    "TERMINATED",
    "LaunchError",
    "LaunchedWorld",
    "Preload",
    "RankResult",
    "collective_timeout_s",
    "format_report",
    "is_collective_error",
    "launch_ranks",
    "launched_world",
    "qualified_name",
    "root_cause",
    "run_on_ranks",
]

GRACE_S = 2.0  # after the first failure: time for peers to report their own error before they are stopped
STARTUP_TIMEOUT_S = float(os.environ.get("DSV4_MULTIRANK_STARTUP_S", "300"))  # imports + unpickling, per call
_RESULTS_MARGIN_S = 30.0  # the results group outlasts the default group's timeout by this much


class LaunchError(Dsv4Error, RuntimeError):
    """One or more ranks failed or did not finish; the message is the per-rank report."""

    def __init__(self, report: str, *, results: Sequence[RankResult]):
        super().__init__(report)
        self.results = list(results)
        self.root_cause = root_cause([r for r in results if not r.ok])


@dataclass(frozen=True)
class LaunchedWorld:
    rank: int
    world_size: int
    local_rank: int


def launched_world(environ: Mapping[str, str] | None = None) -> LaunchedWorld | None:
    """The rank this process already is (torchrun, or inside a spawned rank), or None for a plain process."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    return LaunchedWorld(rank, world_size, int(environ.get("LOCAL_RANK", rank)))


# ------------------------------------------------------------------------------------------- in-process side

_RESULTS_GROUP: tuple[Any, Any] | None = None  # (default group it was made for, gloo group for the results)


def _join_launched_world(world: LaunchedWorld, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # by the caller: assume the collective timeout this call would have chosen
        if collective_timeout_s() is None:
            set_collective_timeout_s(timeout_s / 2)
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=world.rank,
        world_size=world.world_size,
        timeout=timedelta(seconds=timeout_s / 2),
    )
    set_collective_timeout_s(timeout_s / 2)


def _results_group(timeout_s: float) -> Any:
    """A gloo group only for the result exchange (created once per default group, by every rank in step)."""
    global _RESULTS_GROUP
    import torch.distributed as dist

    world_group = dist.group.WORLD
    if _RESULTS_GROUP is None or _RESULTS_GROUP[0] is not world_group:
        outlast = max(timeout_s, collective_timeout_s() or timeout_s) + _RESULTS_MARGIN_S
        _RESULTS_GROUP = (world_group, dist.new_group(backend="gloo", timeout=timedelta(seconds=outlast)))
    return _RESULTS_GROUP[1]


def _run_in_process(
    fn: Callable[..., Any],
    case: bytes,
    *,
    world: LaunchedWorld,
    timeout_s: float,
    preload: Sequence[Preload],
    before_go: Callable[[], object] | None,
) -> list[Any]:
    import torch.distributed as dist

    _join_launched_world(world, timeout_s)
    group = _results_group(timeout_s)
    start_up(preload)
    if before_go is not None:
        dist.barrier(group=group)  # a preload of one rank may write what before_go reads
        before_go()
    interrupted: BaseException | None = None
    try:
        result = RankResult(rank=world.rank, ok=True, payload=fn(world.rank, world.world_size, pickle.loads(case)))
    except BaseException as exc:  # report it to the peers whatever its type; see KeyboardInterrupt below
        result = RankResult.from_exception(world.rank, exc)
        interrupted = exc if isinstance(exc, KeyboardInterrupt) else None
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, result, group=group)
    if interrupted is not None:  # this process is the pytest session too: Ctrl-C must still stop it
        raise interrupted
    return gathered


# -------------------------------------------------------------------------------------------------- entry


def launch_ranks(
    fn: Callable[[int, int, Any], Any],
    case: Any,
    *,
    nproc: int,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    preload: Sequence[Preload] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    grace_s: float = GRACE_S,
    backend: str | None = "gloo",
    before_go: Callable[[], object] | None = None,
) -> list[RankResult]:
    """``fn(rank, world_size, case)`` on ``nproc`` ranks; every rank's :class:`RankResult`, in rank order.

    ``fn`` must be a module-level function (ranks import it by name) and ``case`` must pickle. ``timeout_s`` bounds
    the run from the moment every rank has finished starting up; collectives time out after ``timeout_s / 2``.
    ``env`` adds environment variables in every spawned rank (set before torch is imported). ``preload`` names
    modules to import, or module-level callables to call, in each rank before the clock starts (megatron's import
    takes tens of seconds on a loaded host). ``backend`` is the spawned ranks' process group backend (``"nccl"``:
    rank r drives GPU r; ``None``: NCCL where CUDA is present, else gloo). ``before_go`` runs here once every rank
    has preloaded, before any starts ``fn``: the launcher's own work overlaps the ranks' imports, and what it
    raises stops the ranks unstarted and leaves this call. Never raises for a rank's failure: that is in its result.
    """
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"launch needs a module-level function (ranks import it by name), got {module}.{qualname}")
    try:
        case_bytes = pickle.dumps(case)
    except Exception as exc:
        raise TypeError(f"launch: case {type(case).__name__} does not pickle: {exc}") from exc
    world = launched_world()
    if world is not None:
        if nproc != world.world_size:
            raise ValueError(
                f"{nproc} ranks asked inside a launched world of WORLD_SIZE={world.world_size}: "
                f"ask for {world.world_size} (or launch {nproc} ranks)"
            )
        return _run_in_process(fn, case_bytes, world=world, timeout_s=timeout_s, preload=preload, before_go=before_go)
    rank_env = dict(env or {})
    if "OMP_NUM_THREADS" not in os.environ:  # nproc ranks share the cores: don't oversubscribe them
        rank_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return spawn_ranks(
        module,
        qualname,
        case_bytes,
        nproc=nproc,
        timeout_s=timeout_s,
        startup_timeout_s=startup_timeout_s,
        grace_s=grace_s,
        env=rank_env,
        preload=tuple(preload),
        backend=backend,
        before_go=before_go,
    )


def run_on_ranks(
    fn: Callable[[int, int, Any], Any],
    args: Any,
    *,
    nproc: int,
    timeout_s: float,
    preload: Sequence[Preload] = (),
    before_go: Callable[[], object] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, args)`` on every rank (NCCL, one GPU per rank, where CUDA is present; else gloo); the
    payloads in rank order, or :class:`LaunchError` naming each failed rank (root cause first) when any failed.
    ``before_go``, ``env``: see :func:`launch_ranks`."""
    results = launch_ranks(
        fn, args, nproc=nproc, timeout_s=timeout_s, env=env, preload=preload, backend=None, before_go=before_go
    )
    if any(not r.ok for r in results):
        report = format_report(results, fn_name=fn.__qualname__, world_size=nproc, timeout_s=timeout_s)
        raise LaunchError(report, results=results)
    return [r.payload for r in results]
