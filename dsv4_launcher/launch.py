"""The one rank launcher: run ``fn(rank, world_size, case)`` on N ranks, never hang, report every rank.

Used by the command line (``qualify``: :func:`run_on_ranks`, which raises :class:`LaunchError`) and by the test
suites' runner (``fixtures/runner/multirank.py``, which judges :func:`launch_ranks`' results against declared
expectations).

* Plain process: ``nproc`` ranks are spawned (``dsv4_launcher.spawn``): gloo (the command line: NCCL where CUDA is
  present) over a file store (no ports), a post-init barrier, a hard timeout with stack dumps, SIGTERM then SIGKILL to each rank's process group, every rank joined.
* Inside a launched world (``RANK``/``WORLD_SIZE`` set: torchrun, or a spawned rank calling this again): this
  process is one rank (``dsv4_launcher.in_process``). ``fn`` runs here on the default process group (created with the
  call's backend, which must match an existing one); the ranks first agree on what they run, and the results
  travel through the group's store, so a rank whose function raised does not meet its peers inside their
  collective: every peer prints its failure at once, its collective raises (gloo: at the group's timeout; NCCL:
  aborted after the grace period), and every rank gets every result. There are no stack dumps or kills there.

Whatever ``fn`` raises (``BaseException``: also ``pytest.skip``/``pytest.fail``, ``SystemExit``) becomes that
rank's :class:`RankResult` instead of leaving its peers waiting.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsv4_launcher.errors import LaunchError
from dsv4_launcher.in_process import InProcessCall, gather_in_world, run_in_process
from dsv4_launcher.rank_report import (
    RAISED,
    SIGNALLED,
    TERMINATED,
    RankResult,
    format_report,
    is_collective_error,
    qualified_name,
    root_cause,
)
from dsv4_launcher.spawn import Preload, collective_timeout_s, spawn_ranks

__all__ = [  # the outcome names and report helpers are re-exported for the suites' runner (fixtures/runner/multirank.py)
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
    "gather_in_world",
    "is_collective_error",
    "launch_ranks",
    "launched_world",
    "qualified_name",
    "root_cause",
    "run_on_ranks",
]

GRACE_S = 2.0  # after the first failure: time for peers to report their own error before they are stopped
STARTUP_TIMEOUT_S = float(os.environ.get("DSV4_MULTIRANK_STARTUP_S", "300"))  # imports + unpickling, per call


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


# -------------------------------------------------------------------------------------------------- entry


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


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
    agree: object = None,
    before_go: Callable[[], object] | None = None,
    start_method: str = "spawn",
) -> list[RankResult]:
    """``fn(rank, world_size, case)`` on ``nproc`` ranks; every rank's :class:`RankResult`, in rank order.

    ``fn`` must be a module-level function (ranks import it by name) and ``case`` must pickle. ``timeout_s`` bounds
    the run from the moment every rank has finished starting up; collectives time out after ``timeout_s / 2``.
    ``env`` adds environment variables in every spawned rank (set before torch is imported). ``preload`` names
    modules to import, or module-level callables to call, in each rank before the clock starts (megatron's import
    takes tens of seconds on a loaded host). ``backend`` is the process group backend (``"nccl"``: rank r drives GPU
    ``LOCAL_RANK``; ``None``: NCCL where CUDA is present, else gloo); in a launched world an existing default group
    must have it. ``agree``: a value every rank of a launched world must pass identically (checked with ``fn`` and
    ``case`` before ``fn`` runs). ``before_go`` runs once every rank has preloaded, before any starts ``fn``: the
    launcher's own work overlaps the ranks' imports, and what it raises stops the ranks unstarted and leaves this
    call (in a launched world it runs on every rank and what it raises is that rank's result). Never raises for a
    rank's failure: that is in its result. ``start_method``: how new ranks start (``dsv4_launcher.spawn.spawn_ranks``).
    """
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"launch needs a module-level function (ranks import it by name), got {module}.{qualname}")
    try:
        case_bytes = pickle.dumps(case)
    except Exception as exc:
        raise TypeError(f"launch: case {type(case).__name__} does not pickle: {exc}") from exc
    # the same either way the ranks run: their clocks, what each imports first, the launcher's hook before they start
    given = {
        "timeout_s": timeout_s,
        "startup_timeout_s": startup_timeout_s,
        "grace_s": grace_s,
        "preload": tuple(preload),
        "before_go": before_go,
    }
    world = launched_world()
    if world is not None:
        if nproc != world.world_size:
            raise ValueError(
                f"{nproc} ranks asked inside a launched world of WORLD_SIZE={world.world_size}: "
                f"ask for {world.world_size} (or launch {nproc} ranks)"
            )
        call = InProcessCall(
            world.rank, world.world_size, world.local_rank, backend=backend or _default_backend(), agree=agree, **given
        )
        return run_in_process(fn, case_bytes, call)
    rank_env = dict(env or {})
    if "OMP_NUM_THREADS" not in os.environ:  # nproc ranks share the cores: don't oversubscribe them
        rank_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return spawn_ranks(
        module, qualname, case_bytes, nproc=nproc, env=rank_env, backend=backend, start_method=start_method, **given
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
        raise LaunchError(report, results=results, root_cause=root_cause([r for r in results if not r.ok]))
    return [r.payload for r in results]
