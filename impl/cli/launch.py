"""Run one function on N ranks for the command line: gloo on CPU, NCCL under torchrun on GPU nodes.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the current process is one rank and the function runs
in-process. Otherwise ``nproc`` ranks are spawned, rendezvous through a file store (no ports), every
collective gets ``timeout_s``, and the parent kills every rank's process group when any rank fails or
the deadline passes, so a failing run never leaves processes behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    ok: bool
    payload: Any = None
    error: str = ""


class LaunchError(RuntimeError):
    """One or more ranks failed or did not finish; the message names each."""


def init_distributed(rank: int, world_size: int, *, init_method: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def _rank_entry(fn: Callable[..., Any], rank: int, world: int, args: Any, store: str, timeout_s: float, q) -> None:
    os.setsid()
    try:
        init_distributed(rank, world, init_method=f"file://{store}", timeout_s=timeout_s)
        q.put(RankOutcome(rank, True, fn(rank, world, args)))
    except BaseException as exc:  # every failure must reach the parent, whatever its type
        q.put(RankOutcome(rank, False, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_on_ranks(fn: Callable[[int, int, Any], Any], args: Any, *, nproc: int, timeout_s: float) -> list[Any]:
    """``fn(rank, world_size, args)`` on every rank; returns payloads in rank order or raises :class:`LaunchError`."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_distributed(rank, world, init_method="env://", timeout_s=timeout_s)
        import torch.distributed as dist

        payload = fn(rank, world, args)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, payload)
        return gathered
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dsv4-launch-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_rank_entry, args=(fn, r, nproc, args, store, timeout_s / 2, q), daemon=False)
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < nproc and time.monotonic() < deadline:
                try:
                    o = q.get(timeout=0.5)
                    outcomes[o.rank] = o
                    if not o.ok:
                        deadline = min(deadline, time.monotonic() + 5.0)  # grace for peers' own reports
                except Exception:  # queue.Empty: check for ranks that died without reporting
                    if all(not p.is_alive() for p in procs) and q.empty():
                        break
        finally:
            for p in procs:
                if p.is_alive():
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.join(timeout=10)
        problems = []
        for r, p in enumerate(procs):
            o = outcomes.get(r)
            if o is None:
                why = f"exit code {p.exitcode}" if p.exitcode is not None else f"no result within {timeout_s:.0f}s"
                problems.append(f"rank {r}: did not report ({why})")
            elif not o.ok:
                problems.append(f"rank {r}: {o.error}")
        if problems:
            raise LaunchError(f"{len(problems)}/{nproc} ranks failed:\n" + "\n".join(problems))
        return [outcomes[r].payload for r in range(nproc)]
