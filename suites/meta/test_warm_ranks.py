"""Warm ranks (``fixtures/runner/warm_ranks.py``): a launch whose ranks only preload the implementation under test forks
them from one fork server per test process; a launch that a fresh interpreter could run differently still spawns
fresh ranks; a forked rank's death or hang is reported like a spawned rank's, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import psutil
import pytest
import torch  # at import time: a spawned rank that unpickles a preload of this module imports torch with it

from fixtures.runner.multirank import MultiRankFailure, impl_preload, run_ranks
from fixtures.runner.processes import assert_no_orphans, child_pids
from fixtures.runner.warm_ranks import COLD_ENV, start_method_for

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]


@dataclass(frozen=True)
class Case:
    fate: str = "report"  # report | killed | hang


def _rank_report_origin(rank: int, world_size: int, case: Case) -> dict:
    if case.fate == "killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if case.fate == "hang" and rank == 1:
        time.sleep(300)
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "rank": int(os.environ["RANK"]),
    }


def _launch(impl, **kwargs) -> list[dict]:
    results = run_ranks(_rank_report_origin, Case(), nproc=2, timeout_s=60, **kwargs)
    return [r.payload for r in results]


@pytest.fixture
def fork_server(impl) -> int:
    """The pid of this process's fork server (started by a first warm launch if none ran yet)."""
    (server,) = {r["ppid"] for r in _launch(impl, preload=impl_preload(impl.name))}
    return server


def test_ranks_that_preload_the_implementation_fork_from_one_server_with_the_launch_thread_count(impl, fork_server):
    reports = _launch(impl, preload=impl_preload(impl.name)) + _launch(impl, preload=impl_preload(impl.name))
    assert fork_server != os.getpid()
    assert {r["ppid"] for r in reports} == {fork_server}, (
        f"not all forked from the fork server {fork_server}: {reports}"
    )
    server = psutil.Process(fork_server)
    assert server.ppid() == os.getpid() and "forkserver" in " ".join(server.cmdline()), server.cmdline()
    assert [r["rank"] for r in reports] == [0, 1, 0, 1]
    for r in reports:  # torch was imported in the server, before this launch chose the ranks' thread count
        assert r["omp"] and r["threads"] == int(r["omp"]), f"rank {r['rank']}: {r['threads']} threads, {r}"


def _preload_of_a_module_that_imports_torch() -> None:
    """A preload named by a function: a spawned rank imports its module (this one, and torch with it) while it
    unpickles its spec, before the launch's environment is applied, as qualify's preload does."""


def test_a_spawned_rank_whose_preload_imported_torch_early_runs_the_launch_thread_count(impl):
    """torch reads ``OMP_NUM_THREADS`` once, at import: the rank must still get the launch's count, not the host's
    default (which oversubscribes the cores beside other work)."""
    want = (os.cpu_count() or 1) + 1  # never torch's default, which is at most the cores
    preload = (_preload_of_a_module_that_imports_torch,)
    (report,) = _launch_one(preload, {"OMP_NUM_THREADS": str(want)})
    assert report["omp"] == str(want) and report["threads"] == want, f"the rank runs {report['threads']} threads"


def _launch_one(preload, env) -> list[dict]:
    assert start_method_for(preload, env, "gloo") == "spawn", "a fresh interpreter, not the fork server"
    return [r.payload for r in run_ranks(_rank_report_origin, Case(), nproc=1, timeout_s=60, preload=preload, env=env)]


@pytest.mark.parametrize("why", ["own-environment", "other-preload", "cold-asked", "environment-changed", "nccl"])
def test_a_launch_a_fresh_interpreter_could_run_differently_gets_fresh_ranks(impl, fork_server, monkeypatch, why):
    preload, env, backend = impl_preload(impl.name), None, "gloo"
    assert start_method_for(preload, env, backend) == "forkserver"
    if why == "own-environment":
        env = {"DSV4_PROBE": "1"}
    elif why == "other-preload":
        preload = ("colorsys",)
    elif why == "cold-asked":
        monkeypatch.setenv(COLD_ENV, "1")
    elif why == "environment-changed":  # read at import time by something, perhaps: the server has the old value
        monkeypatch.setenv("DSV4_PROBE_CHANGED", "1")
    else:
        backend = "nccl"
    assert start_method_for(preload, env, backend) == "spawn", why


def test_the_runner_spawns_what_it_may_not_fork(impl, fork_server):
    reports = _launch(impl, preload=("colorsys",))
    assert {r["ppid"] for r in reports} == {os.getpid()}, f"ranks should be this process's own: {reports}"


def _failed_launch(impl, fate: str, timeout_s: float) -> str:
    """Two warm ranks whose rank 1 meets ``fate``: the launch must fail and leave no process behind; its report."""
    before = child_pids()
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_report_origin, Case(fate), nproc=2, timeout_s=timeout_s, preload=impl_preload(impl.name))
    assert_no_orphans(before, [r.pid for r in info.value.results])
    return str(info.value)


def test_a_forked_rank_killed_by_a_signal_is_reported_with_the_signal_name(impl, fork_server):
    report = _failed_launch(impl, "killed", timeout_s=20)
    assert "\nroot cause: rank 1 killed by SIGKILL (exit -9)\n" in report, report
    assert psutil.Process(fork_server).is_running(), "the fork server went down with its rank"


def test_a_hanging_forked_rank_is_stopped_at_the_timeout_with_its_stack(impl, fork_server):
    report = _failed_launch(impl, "hang", timeout_s=3)
    assert "\nroot cause: rank 1 did not finish within 3s\n" in report, report
    assert "in _rank_report_origin" in report, "the hung rank's stack dump is missing:\n" + report
