"""A rank that raises before a collective, in the GPU suite's world: every rank reports it within the timeout.

On GPUs (NCCL)::

    torchrun --nproc-per-node 8 -m pytest -m gpu suites/reference/test_gpu_rank_failure.py -rs

Rehearsed on the CPU (torchrun's ranks on gloo; ``.ci/run`` does this)::

    torchrun --nproc-per-node 4 -m pytest -m gpu --rehearse suites/reference/test_gpu_rank_failure.py

Under torchrun each rank's pytest runs this test: rank ``nproc - 1`` raises while its peers wait in an all-reduce.
Every peer prints ``[rank r] rank <f>: ValueError: ...`` as soon as the failure is posted, its collective then
raises (gloo: at the group's timeout; NCCL: aborted), and every rank's report names the root cause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from fixtures.runner.multirank import MultiRankFailure, launched_world, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]

TIMEOUT_S = 20  # collectives time out after half of it


@dataclass(frozen=True)
class RaiseCase:
    failing_rank: int
    message: str


def _rank_raises_before_all_reduce(rank: int, world_size: int, case: RaiseCase) -> float:
    if rank == case.failing_rank:
        raise ValueError(case.message)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # the failing rank never joins
    return total.item()  # on NCCL the wait happens here


def test_a_rank_raising_before_a_collective_is_reported_by_every_rank_within_the_timeout(nproc, capfd):
    if nproc < 2:
        pytest.skip("needs a peer: run with at least 2 ranks")
    failing = nproc - 1
    case = RaiseCase(failing, f"rank {failing} refuses its shard")
    start = time.monotonic()
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_raises_before_all_reduce, case, nproc=nproc, timeout_s=TIMEOUT_S)
    elapsed, report = time.monotonic() - start, str(info.value)
    world = launched_world()
    me = "this process" if world is None else f"rank {world.rank}"
    assert f"\nroot cause: rank {failing} ValueError: {case.message}\n" in report, f"report on {me}:\n{report}"
    peers = [r for r in info.value.results if r.rank != failing]
    assert len(peers) == nproc - 1 and all(not r.ok for r in peers), f"report on {me}:\n{report}"
    assert elapsed < TIMEOUT_S, f"{me} took {elapsed:.1f}s (timeout {TIMEOUT_S}s) to report:\n{report}"
    if world is not None and world.rank != failing:  # the peer's notice, printed while it waited in its collective
        notice = f"[rank {world.rank}] rank {failing}: ValueError: {case.message}"
        assert notice in capfd.readouterr().err, f"rank {world.rank} did not print {notice!r}"
