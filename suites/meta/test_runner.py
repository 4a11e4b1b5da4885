"""The multi-rank runner's contract: results in rank order, one torchrun-shaped report naming the rank that
broke, a hard timeout with stack dumps, declared expected failures, and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fixtures.ranks.faults import InjectedFault, fail_on_rank, kill_self_on_rank
from fixtures.runner.multirank import (
    CPU_WORLD,
    AllRanksRaise,
    LaunchedWorld,
    MultiRankFailure,
    RankFailure,
    RankResult,
    format_report,
    judge,
    launched_world,
    rank_world,
    run_ranks,
)
from fixtures.runner.processes import assert_no_orphans, child_pids

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]


@dataclass(frozen=True)
class Case:
    value: float = 1.0
    pid_file: str = ""


class _Store:
    @staticmethod
    def save(rank: int) -> int:
        return rank


# ------------------------------------------------------------------------------------ rank functions (no megatron)


def _rank_allreduce(rank: int, world_size: int, case: Case) -> dict:
    total = torch.tensor([case.value * (rank + 1)])
    dist.all_reduce(total)
    return {"rank": rank, "world_size": world_size, "sum": total.item(), "env_rank": int(os.environ["RANK"])}


def _rank_report_preload(rank: int, world_size: int, case: Case) -> dict:
    return {**_rank_allreduce(rank, world_size, case), "preloaded": "colorsys" in sys.modules}


def _rank_one_raises(rank: int, world_size: int, case: Case) -> None:
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    time.sleep(60)  # outside any collective: only the runner can stop this rank


def _rank_all_raise(rank: int, world_size: int, case: Case) -> None:
    dist.barrier()
    raise LookupError("missing layers.0.attn.wq_b")


def _rank_hang_with_grandchild(rank: int, world_size: int, case: Case) -> int:
    if rank == 1:
        child = subprocess.Popen(["sleep", "300"])
        Path(case.pid_file).write_text(str(child.pid))
        time.sleep(300)
    return rank


def _rank_killed(rank: int, world_size: int, case: Case) -> int:
    kill_self_on_rank(1, signal.SIGKILL)
    dist.barrier()  # rank 0 waits here for a peer that is gone
    return rank


def _rank_injected(rank: int, world_size: int, case: Case) -> int:
    with fail_on_rank(1, _Store, "save"):
        return _Store.save(rank)


def _rank_nested(rank: int, world_size: int, case: Case) -> list:
    # Inside a rank RANK/WORLD_SIZE are set, as under torchrun: run_ranks runs in-process on the live group.
    return [r.payload for r in run_ranks(_rank_allreduce, case, nproc=world_size, timeout_s=10)]


def _skip(message: str) -> None:
    pytest.skip(message)


def _fail(message: str) -> None:
    pytest.fail(message)


@dataclass(frozen=True)
class GiveUpCase:
    give_up: Callable[[str], None]  # _skip or _fail: each raises a BaseException that is not an Exception
    timeout_s: float = 10


def _rank_gives_up_while_peer_waits(rank: int, world_size: int, case: GiveUpCase) -> int:
    if rank == 1:
        case.give_up(f"rank 1 gives up in {case.give_up.__name__}")
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return rank


def _rank_nested_gives_up(rank: int, world_size: int, case: GiveUpCase) -> str:
    try:
        run_ranks(_rank_gives_up_while_peer_waits, case, nproc=world_size, timeout_s=case.timeout_s)
    except MultiRankFailure as exc:
        return str(exc)
    return "the in-process run_ranks did not fail"


def _rank_nested_in_its_own_test(rank: int, world_size: int, case: Case) -> str:
    # Under torchrun each rank's pytest passes its test id: here rank r claims to run test r (drifted collections).
    with rank_world(CPU_WORLD, label=f"suites/reference/test_x.py::test_{rank}"):
        try:
            run_ranks(_rank_allreduce, case, nproc=world_size, timeout_s=10)
        except MultiRankFailure as exc:
            return str(exc)
    return "the in-process run_ranks did not fail"


# ------------------------------------------------------------------------------------------------- orphans


@pytest.fixture
def children_before() -> set[int]:
    return child_pids()


# ------------------------------------------------------------------------------------------------ live runs


def test_payloads_come_back_in_rank_order(children_before):
    results = run_ranks(_rank_report_preload, Case(value=2.0), nproc=2, timeout_s=10, preload=("colorsys",))
    assert [r.payload for r in results] == [
        {"rank": 0, "world_size": 2, "sum": 6.0, "env_rank": 0, "preloaded": True},
        {"rank": 1, "world_size": 2, "sum": 6.0, "env_rank": 1, "preloaded": True},
    ]
    assert all(r.ok and r.exitcode == 0 for r in results), results
    assert_no_orphans(children_before, [r.pid for r in results])


def test_one_rank_raising_names_it_and_stops_its_peer(children_before):
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_one_raises, Case(), nproc=2, timeout_s=10)
    report = str(info.value)
    assert report.startswith("2/2 ranks failed in _rank_one_raises (world_size=2, timeout=10s)\n"), report
    assert "\nroot cause: rank 1 ValueError: bad shard on rank 1\n" in report, report
    assert "\nrank 0: still running 2s after a peer failed; terminated\n" in report, report
    assert 'raise ValueError("bad shard on rank 1")' in report, "rank 1's traceback is missing:\n" + report
    assert "in _rank_one_raises" in info.value.results[0].stack_dump, "rank 0's stack dump is missing:\n" + report
    assert info.value.root_cause.rank == 1
    assert_no_orphans(children_before, [r.pid for r in info.value.results])


def test_all_ranks_raising_is_reported_rank_by_rank_and_matches_all_ranks_raise(children_before):
    expect = AllRanksRaise(exc=LookupError, match=r"layers\.0\.attn\.wq_b", same_message=True)
    results = run_ranks(_rank_all_raise, Case(), nproc=2, timeout_s=10, expect=expect)
    assert [(r.rank, r.exc_type) for r in results] == [(0, "LookupError"), (1, "LookupError")]
    with pytest.raises(MultiRankFailure) as info:
        judge(results, fn_name="_rank_all_raise", world_size=2, timeout_s=10, expect=None)
    report = str(info.value)
    assert report.startswith("2/2 ranks failed in _rank_all_raise"), report
    assert report.count("LookupError: missing layers.0.attn.wq_b") == 4, report  # 2 summary lines + 2 tracebacks
    assert_no_orphans(children_before, [r.pid for r in results])


def test_hanging_rank_is_killed_with_its_children_at_the_timeout(children_before, tmp_path):
    case = Case(pid_file=str(tmp_path / "grandchild.pid"))
    start = time.monotonic()
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_hang_with_grandchild, case, nproc=2, timeout_s=3)
    report = str(info.value)
    assert "\nroot cause: rank 1 did not finish within 3s\n" in report, report
    assert "\nok: rank 0\n" in report, report
    assert "in _rank_hang_with_grandchild" in report, "the hung rank's stack dump is missing:\n" + report
    grandchild = int(Path(case.pid_file).read_text())
    assert_no_orphans(children_before, [r.pid for r in info.value.results] + [grandchild])
    print(f"hang case: {time.monotonic() - start:.1f}s including startup")


def test_rank_killed_by_a_signal_is_reported_with_the_signal_name(children_before):
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_killed, Case(), nproc=2, timeout_s=10)
    report = str(info.value)
    assert "\nroot cause: rank 1 killed by SIGKILL (exit -9)\n" in report, report
    rank0 = info.value.results[0]
    assert not rank0.ok and rank0.outcome in ("raised", "terminated"), f"rank 0 should fail with its peer: {report}"
    assert_no_orphans(children_before, [r.pid for r in info.value.results])


def test_declared_injected_fault_returns_the_results(children_before):
    expect = RankFailure(rank=1, exc=InjectedFault, match=r"injected fault on rank 1: _Store\.save")
    results = run_ranks(_rank_injected, Case(), nproc=2, timeout_s=10, expect=expect)
    assert (results[0].ok, results[0].payload) == (True, 0)
    assert (results[1].outcome, results[1].exc_type) == ("raised", "InjectedFault")
    assert_no_orphans(children_before, [r.pid for r in results])


def test_inside_a_launched_world_run_ranks_runs_in_process(children_before):
    results = run_ranks(_rank_nested, Case(value=1.0), nproc=2, timeout_s=10)
    expected = [{"rank": r, "world_size": 2, "sum": 3.0, "env_rank": r} for r in (0, 1)]
    assert [r.payload for r in results] == [expected, expected]
    assert_no_orphans(children_before, [r.pid for r in results])


GIVE_UPS = [
    pytest.param(_skip, pytest.skip.Exception, id="pytest.skip"),
    pytest.param(_fail, pytest.fail.Exception, id="pytest.fail"),
]


@pytest.mark.parametrize(("give_up", "exc_class"), GIVE_UPS)
def test_pytest_skip_or_fail_inside_a_rank_is_reported_not_left_hanging(children_before, give_up, exc_class):
    case = GiveUpCase(give_up)
    start = time.monotonic()
    with pytest.raises(MultiRankFailure) as info:
        run_ranks(_rank_gives_up_while_peer_waits, case, nproc=2, timeout_s=case.timeout_s)
    report, wall, returned_at = str(info.value), time.monotonic() - start, time.time()
    exc = exc_class.__qualname__  # Skipped / Failed
    assert f"\nroot cause: rank 1 {exc}: rank 1 gives up in {give_up.__name__}\n" in report, report
    rank0, rank1 = info.value.results
    assert not rank0.ok and rank0.outcome in ("raised", "terminated"), f"rank 0 should fail with its peer: {report}"
    assert returned_at - rank1.finished_at < case.timeout_s, (
        f"the run outlived its timeout after rank 1 gave up:\n{report}"
    )
    assert_no_orphans(children_before, [r.pid for r in info.value.results])
    print(f"{give_up.__name__} in a rank: {wall:.1f}s including startup; rank 0: {rank0.summary()}")


@pytest.mark.parametrize(("give_up", "exc_class"), GIVE_UPS)
def test_pytest_skip_or_fail_inside_an_in_process_rank_is_reported_on_every_rank(give_up, exc_class):
    """The torchrun path: each rank runs run_ranks in-process; rank 1 gives up while rank 0 waits in a barrier.
    Rank 0's barrier times out (the outer group's timeout_s / 2), then both ranks exchange their results."""
    inner = GiveUpCase(give_up, timeout_s=6)
    reports = [r.payload for r in run_ranks(_rank_nested_gives_up, inner, nproc=2, timeout_s=12)]
    exc = exc_class.__qualname__
    for rank, report in enumerate(reports):
        lines = report.splitlines()
        assert lines[:2] == [
            "2/2 ranks failed in _rank_gives_up_while_peer_waits (world_size=2, timeout=6s)",
            f"root cause: rank 1 {exc}: rank 1 gives up in {give_up.__name__}",
        ], f"report on rank {rank}:\n{report}"
        assert lines[2].startswith("rank 0: ") and lines[2].endswith("(collective error, likely collateral)"), (
            f"rank 0 should report its timed-out barrier; report on rank {rank}:\n{report}"
        )


def test_in_process_ranks_running_different_tests_all_raise_before_the_body_runs():
    """Ranks whose collections drifted apart meet in the same run_ranks call with different test ids: every rank
    raises RanksDisagree naming each rank's test before any rank reaches the body's all-reduce."""
    reports = [r.payload for r in run_ranks(_rank_nested_in_its_own_test, Case(), nproc=2, timeout_s=20)]
    for rank, report in enumerate(reports):
        assert report.startswith("2/2 ranks failed in _rank_allreduce"), f"report on rank {rank}:\n{report}"
        for r in (0, 1):
            assert f"rank {r}: RanksDisagree: the ranks are not running the same call" in report or (
                f"root cause: rank {r} RanksDisagree: the ranks are not running the same call" in report
            ), f"rank {r} did not raise RanksDisagree; report on rank {rank}:\n{report}"
            assert f"test_x.py::test_{r}" in report, f"the report does not name rank {r}'s test:\n{report}"


# ------------------------------------------------------------------------------ pure logic (no processes)


def test_launched_world_is_detected_from_torchrun_variables():
    assert launched_world({}) is None
    assert launched_world({"RANK": "3"}) is None
    assert launched_world({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == LaunchedWorld(3, 8, 1)
    assert launched_world({"RANK": "2", "WORLD_SIZE": "4"}) == LaunchedWorld(2, 4, 2)


def _module_level_helper(rank: int, world_size: int, case: object) -> None:
    return None


def test_run_ranks_rejects_what_ranks_cannot_import_or_unpickle():
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda rank, world_size, case: None, Case(), nproc=2)
    with pytest.raises(TypeError, match="does not pickle"):
        run_ranks(_module_level_helper, lambda: None, nproc=2)


def _raised(rank: int, exc: BaseException) -> RankResult:
    return RankResult.from_exception(rank, exc)


GLOO_RESET = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection reset by peer")


def test_report_has_torchrun_shape():
    results = [
        RankResult(rank=0, ok=False, outcome="timeout", message="did not finish within 30s"),
        _raised(1, KeyError("ExportError stand-in")),
        RankResult(rank=2, ok=False, outcome="signalled", exitcode=-9, message="killed by SIGKILL (exit -9)"),
        _raised(3, GLOO_RESET),
    ]
    report = format_report(results, fn_name="_rank_export", world_size=4, timeout_s=30)
    lines = report.splitlines()
    assert lines[:5] == [
        "4/4 ranks failed in _rank_export (world_size=4, timeout=30s)",
        "root cause: rank 1 KeyError: 'ExportError stand-in'",
        "rank 0: did not finish within 30s",
        "rank 2: killed by SIGKILL (exit -9)",
        f"rank 3: RuntimeError: {GLOO_RESET} (collective error, likely collateral)",
    ], report
    assert "--- rank 1 traceback ---" in report and "--- rank 3 traceback ---" in report


def test_expectation_met_returns_results_with_collateral_peers():
    results = [_raised(0, GLOO_RESET), _raised(1, InjectedFault("injected fault on rank 1: io.save"))]
    assert (
        judge(results, fn_name="f", world_size=2, timeout_s=5, expect=RankFailure(rank=1, exc=RuntimeError)) == results
    )
    assert judge(results, fn_name="f", world_size=2, timeout_s=5, expect=[RankFailure(rank=None, exc=InjectedFault)])
    assert judge(results, fn_name="f", world_size=2, timeout_s=5, expect=lambda rs: rs[1].exc_type == "InjectedFault")


@pytest.mark.parametrize(
    ("results", "expect", "problem"),
    [
        pytest.param(
            [RankResult(rank=0, ok=True), RankResult(rank=1, ok=True)],
            RankFailure(rank=1, exc=InjectedFault),
            "expected RankFailure(rank=1, exc=InjectedFault), got rank 1: ok",
            id="expected-rank-succeeded",
        ),
        pytest.param(
            [RankResult(rank=0, ok=True), _raised(1, ValueError("x"))],
            RankFailure(rank=1, exc=InjectedFault),
            "got rank 1: ValueError: x",
            id="wrong-exception-type",
        ),
        pytest.param(
            [RankResult(rank=0, ok=True), _raised(1, InjectedFault("on rank 1"))],
            RankFailure(rank=1, exc=InjectedFault, match="rank 0"),
            "match='rank 0'), got rank 1: InjectedFault: on rank 1",
            id="message-does-not-match",
        ),
        pytest.param(
            [_raised(0, TypeError("unrelated")), _raised(1, InjectedFault("on rank 1"))],
            RankFailure(rank=1, exc=InjectedFault),
            "rank 0: unexpected failure TypeError: unrelated",
            id="unexpected-second-failure",
        ),
        pytest.param(
            [_raised(0, LookupError("a")), _raised(1, LookupError("b"))],
            AllRanksRaise(exc=LookupError, same_message=True),
            "ranks raised different messages: a | b",
            id="messages-differ",
        ),
        pytest.param(
            [_raised(0, LookupError("a")), RankResult(rank=1, ok=True)],
            AllRanksRaise(exc=LookupError),
            "rank 1: expected LookupError, got ok",
            id="one-rank-did-not-raise",
        ),
        pytest.param(
            [RankResult(rank=0, ok=True), RankResult(rank=1, ok=False, outcome="signalled", exitcode=-15)],
            RankFailure(rank=1, signal=signal.SIGKILL),
            "expected RankFailure(rank=1, signal=SIGKILL)",
            id="wrong-signal",
        ),
    ],
)
def test_expectation_not_met_raises_naming_the_mismatch(results, expect, problem):
    with pytest.raises(MultiRankFailure, match="expected failure pattern not met") as info:
        judge(results, fn_name="f", world_size=2, timeout_s=5, expect=expect)
    assert problem in str(info.value), str(info.value)


def test_rank_failure_needs_exactly_one_of_exc_or_signal():
    with pytest.raises(TypeError, match="exactly one of exc="):
        RankFailure(rank=0)
    with pytest.raises(TypeError, match="exactly one of exc="):
        RankFailure(rank=0, exc=ValueError, signal=signal.SIGKILL)


def test_fault_patches_are_undone_on_exit(monkeypatch):
    import inspect

    import torch.distributed as dist

    import fixtures.ranks.faults as faults

    before_static = inspect.getattr_static(_Store, "save")
    instance = _Store()
    with faults.fail_on_rank(1, _Store, "save"), faults.kill_on_rank(1, instance, "save"):
        assert inspect.getattr_static(_Store, "save") is not before_static
        assert "save" in vars(instance)
    assert inspect.getattr_static(_Store, "save") is before_static
    assert "save" not in vars(instance), "an attribute the instance did not own must be deleted, not pinned"
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # an earlier test of this worker may have set one up
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        faults.global_rank()
