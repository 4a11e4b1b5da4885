"""The adapter export is a collective that fails closed on every rank, in every phase, and never hangs.

Fault matrix: world sizes 1, 2, 4 (8 with ``--nproc 8``) x failing rank x export phase. Each world size runs its
whole matrix inside ONE spawned gloo group (cases run back to back, a barrier between them), which also proves
that a failed export leaves the process group usable. Ranks reach the exporter only through the public API of the
implementation under test (its name travels in the case): they inject each fault by passing ``export_adapter`` a
copy of the implementation's own phase table with that phase wrapped (``fixtures.ranks.faults.phases_with_fault``), and
they never import megatron (the exporter does not need it; importing it would cost every rank tens of seconds).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from fixtures.data.adapter_states import snapshot_tree
from fixtures.ranks.export_rank_fns import (
    EXCHANGE_TIMEOUT_S,
    KILL_EXCHANGE_TIMEOUT_S,
    PHASES,
    MatrixCase,
    OutcomeCase,
    adapter_state,
    export_attempt,
    matrix,
    rank_export_matrix,
    survivors_of_a_kill,
    survivors_of_a_matrix_kill,
    validity,
)
from fixtures.ranks.faults import phases_with_fault
from fixtures.runner.impl_loader import load_impl
from fixtures.runner.multirank import run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

_WORLD_SIZES = (1, 2, 4, 8)


#: the tests of the fault matrix's results: one worker runs the matrix once
MATRIX_GROUP = pytest.mark.xdist_group("export-fault-matrix")


class _Matrix:
    """Each world size's fault matrix, run once when a test first asks for it: a selection of one world size (CI's
    wider run, ``--nproc 8 -k ws8``) runs only that one. {world_size: per-rank case lists}."""

    def __init__(self, impl_name: str, nproc: int, tmp_path_factory: pytest.TempPathFactory):
        self.sizes = tuple(ws for ws in _WORLD_SIZES if ws <= max(nproc, 4))
        self._impl_name, self._tmp = impl_name, tmp_path_factory
        self._done: dict[int, list[list[dict]]] = {}

    def __getitem__(self, ws: int) -> list[list[dict]]:
        if ws not in self._done:
            root = self._tmp.mktemp(f"export-ws{ws}")
            results = run_ranks(rank_export_matrix, MatrixCase(self._impl_name, str(root), ws), nproc=ws, timeout_s=240)
            self._done[ws] = [r.payload for r in results]
        return self._done[ws]

    def items(self) -> Iterator[tuple[int, list[list[dict]]]]:
        return ((ws, self[ws]) for ws in self.sizes)


@pytest.fixture(scope="module")
def matrix_results(impl, nproc: int, tmp_path_factory: pytest.TempPathFactory) -> _Matrix:
    return _Matrix(impl.name, nproc, tmp_path_factory)


@MATRIX_GROUP
@pytest.mark.parametrize(
    "world_size,case_id,fail_rank,phase",
    [pytest.param(ws, cid, r, p, id=cid) for ws in _WORLD_SIZES for cid, r, p in matrix(ws)],
)
def test_failure_in_any_phase_on_any_rank_raises_the_same_error_everywhere_and_publishes_nothing(
    matrix_results, nproc: int, world_size: int, case_id: str, fail_rank: int, phase: str
) -> None:
    if world_size not in matrix_results.sizes:
        pytest.skip(f"world size {world_size} needs --nproc {world_size}")
    per_rank = [{c["id"]: c for c in payload}[case_id] for payload in matrix_results[world_size]]
    errors = [c["error"] for c in per_rank]
    assert all(e is not None for e in errors), (
        f"{case_id}: ranks {[i for i, e in enumerate(errors) if e is None]} did not raise"
    )
    assert len(set(errors)) == 1, f"{case_id}: ranks raised different errors: {errors}"
    assert f"rank {fail_rank}: OSError: writer failed ({case_id})" in errors[0], f"{case_id}: {errors[0]}"
    assert f"failed in phase {phase}" in errors[0], f"{case_id}: {errors[0]}"
    for rank, c in enumerate(per_rank):
        assert c["unchanged"], f"{case_id}: rank {rank} sees the destination changed: {c['changed']}"
        assert c["elapsed"] < EXCHANGE_TIMEOUT_S, f"{case_id}: rank {rank} took {c['elapsed']:.1f}s (a timeout?)"


def test_the_matrix_injects_into_every_phase_of_the_implementation_in_protocol_order(impl) -> None:
    """The fault matrix covers PHASES; the implementation's public phase table must be exactly those phases, in
    that order (a phase it added would otherwise never see a fault)."""
    names = tuple(name for name, _ in impl.EXPORT_PHASES)
    assert names == PHASES, f"{impl.name}.EXPORT_PHASES is {names}, the protocol (and this matrix) is {PHASES}"
    assert all(callable(run) for _, run in impl.EXPORT_PHASES), "every phase must be a function of the context"


@MATRIX_GROUP
def test_exporter_ranks_never_import_megatron(matrix_results) -> None:
    """The exporter needs only torch and safetensors: ranks that only export stay free of megatron's import."""
    for ws, payloads in matrix_results.items():
        for rank, payload in enumerate(payloads):
            imported = payload[-1]["megatron"]
            assert not imported, f"world size {ws}, rank {rank}: the export imported megatron ({imported})"


@MATRIX_GROUP
def test_matrix_case_count(matrix_results) -> None:
    """Reports how many fault cases ran (and that every world size ran all of its cases)."""
    counts = {ws: len(payloads[0]) for ws, payloads in matrix_results.items()}
    for ws, n in counts.items():
        assert n == len(matrix(ws)), f"world size {ws}: {n} cases ran, {len(matrix(ws))} declared"
    print(f"export fault matrix: {counts} = {sum(counts.values())} cases")


@pytest.mark.parametrize(
    "world_size,kill_rank,phase",
    [
        pytest.param(2, 1, "write", id="ws2-kill-rank1-write"),
        pytest.param(2, 0, "publish", id="ws2-kill-rank0-publish"),
    ],
)
def test_a_rank_killed_mid_export_is_reported_dead_by_every_survivor_and_nothing_is_published(
    impl, tmp_path: Path, world_size: int, kill_rank: int, phase: str
) -> None:
    survivors = survivors_of_a_matrix_kill(impl.name, tmp_path, world_size, kill=(kill_rank, phase))
    for r in survivors:
        (c,) = r.payload
        assert c["error"] is not None, f"rank {r.rank} did not raise after rank {kill_rank} died"
        assert f"rank {kill_rank}: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s" in c["error"], c["error"]
        assert "(dead or hung)" in c["error"], c["error"]
        assert c["unchanged"], f"rank {r.rank}: destination changed after rank {kill_rank} died: {c['changed']}"
        # "unchanged" compares snapshots: they must hold the earlier export, or an empty tree would pass
        assert c["complete"] and c["valid"] == "valid", (
            f"rank {r.rank}: the earlier export no longer stands complete and valid: {c['valid']}"
        )
    assert len({r.payload[0]["error"] for r in survivors}) == 1, "survivors raised different errors"


@pytest.mark.parametrize(
    "world_size,kill_rank",
    [
        pytest.param(2, 1, id="ws2-kill-rank1-after-commit-point"),
        pytest.param(4, 2, id="ws4-kill-rank2-after-commit-point"),
        pytest.param(2, 0, id="ws2-kill-writer-after-commit-point"),
    ],
)
def test_a_rank_lost_after_the_commit_point_is_reported_and_the_committed_export_stands(
    impl, tmp_path: Path, world_size: int, kill_rank: int
) -> None:
    """Killed in the commit phase, after the writer's commit rename: the survivors still raise the same error
    naming the lost rank, but it says the adapter WAS committed (or, for a lost writer, that the destination is
    the new export or the old one), and the destination is the new complete export with no sidecars left."""
    survivors = survivors_of_a_matrix_kill(impl.name, tmp_path, world_size, kill=(kill_rank, "commit"))
    cleaner = 0 if kill_rank != 0 else 1  # the writer, or the survivor that recovers for a lost writer
    for r in survivors:
        (c,) = r.payload
        assert c["error"] is not None, f"rank {r.rank} did not raise after rank {kill_rank} died"
        assert f"rank {kill_rank}: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase commit" in c["error"]
        assert "Nothing was published" not in c["error"], f"rank {r.rank} denies a committed export: {c['error']}"
        assert ("WAS committed" if kill_rank != 0 else "never a mix") in c["error"], c["error"]
        assert not c["unchanged"], f"rank {r.rank}: the committed export was rolled back"
        assert c["valid"] == "valid", f"rank {r.rank}: the committed destination does not validate: {c['valid']}"
        if r.rank == cleaner:  # peers may look before the cleaning rank has deleted the old export
            assert c["leftovers"] == [], f"rank {r.rank}: sidecars left next to the destination: {c['leftovers']}"
    assert len({r.payload[0]["error"] for r in survivors}) == 1, "survivors raised different errors"


@dataclass(frozen=True)
class StoreHostCase:
    impl: str
    root: str
    writer_fails: bool = False  # the store lost inside the commit: the writer's own commit rename fails too


def _regroup_over_a_store_rank_0_hosts(rank: int, world_size: int) -> None:
    """Re-form the default group over a TCP store that rank 0 hosts, as torchrun's rendezvous does: when rank 0
    dies, the store goes with it."""
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [host.port if host is not None else None]
    dist.broadcast_object_list(port, src=0)
    store = host or dist.TCPStore("127.0.0.1", port[0], world_size, is_master=False)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S))  # fmt: skip


def _rank_export_after_the_store_host_died(rank: int, world_size: int, case: StoreHostCase) -> dict:
    """One export over a store rank 0 hosts, then rank 0 dies and its store with it; what the survivor's next export
    raised."""
    import torch.distributed as dist

    api = load_impl(case.impl, prepare=False)
    _regroup_over_a_store_rank_0_hosts(rank, world_size)
    dest = Path(case.root) / "adapter"
    api.export_adapter(lambda: adapter_state(api, rank, 0), dest, timeout_s=EXCHANGE_TIMEOUT_S)
    dist.barrier(timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S))
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    error, started = None, time.monotonic()
    try:
        api.export_adapter(lambda: adapter_state(api, rank, 1), dest, timeout_s=KILL_EXCHANGE_TIMEOUT_S)
    except api.CollectiveExportError as err:
        error = str(err)
    valid = validity(api, dest)
    return {"error": error, "elapsed": time.monotonic() - started, "valid": valid}


def test_a_dead_store_host_is_named_by_every_survivor_and_the_earlier_export_stands(impl, tmp_path: Path) -> None:
    """Under torchrun's rendezvous rank 0 hosts the group's store: when it dies, the store goes too. The survivor's
    export still raises the collective error, naming rank 0 as the dead or hung store host within the timeout,
    and the earlier export stays complete and valid."""
    (survivor,) = survivors_of_a_kill(
        _rank_export_after_the_store_host_died, StoreHostCase(impl.name, str(tmp_path)), nproc=2, killed=0
    )
    said = survivor.payload["error"]
    assert said is not None, "rank 1 exported after rank 0 and its store died"
    assert f"rank 0: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase gather" in said, said
    assert "store host dead or hung" in said and "Nothing was published" in said, said
    assert survivor.payload["elapsed"] < EXCHANGE_TIMEOUT_S, f"rank 1 took {survivor.payload['elapsed']:.1f}s"
    assert survivor.payload["valid"] == "valid", f"the earlier export no longer validates: {survivor.payload['valid']}"


def _rank_0_waits_in_commit_for_its_peers(phases, flags: Path, world_size: int):
    """``phases`` with every rank marking its entry into the commit phase and rank 0 doing its commit only once every
    peer is inside it (else a peer still reading the marker phase's statuses would lose the store there)."""
    import torch.distributed as dist

    flags.mkdir(exist_ok=True)

    def wrap(run):
        def commit(ctx) -> None:
            (flags / str(dist.get_rank())).touch()
            deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
            while dist.get_rank() == 0 and time.monotonic() < deadline:
                if all((flags / str(r)).exists() for r in range(world_size)):
                    break
                time.sleep(0.01)
            run(ctx)

        return commit

    return tuple((name, wrap(run) if name == "commit" else run) for name, run in phases)


def _rank_store_lost_inside_the_commit(rank: int, world_size: int, case: StoreHostCase) -> dict:
    """Over a store rank 0 hosts: an export by writer rank 1, then another in which rank 0 dies in the commit phase
    (its store with it) while the writer's own commit rename fails; what each survivor raised and found."""
    import torch.distributed as dist

    api = load_impl(case.impl, prepare=False)
    _regroup_over_a_store_rank_0_hosts(rank, world_size)
    dest = Path(case.root) / "out" / "adapter"  # the flags stay outside the tree the snapshots compare
    api.export_adapter(lambda: adapter_state(api, rank, 0, 1), dest, writer_rank=1, timeout_s=EXCHANGE_TIMEOUT_S)
    dist.barrier(timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S))
    before = snapshot_tree(dest)
    phases = phases_with_fault(api.EXPORT_PHASES, "commit", 0, None, writer_rank=1)  # rank 0 dies there
    if case.writer_fails:
        phases = phases_with_fault(phases, "commit", 1, OSError("commit rename failed"), writer_rank=1)
    phases = _rank_0_waits_in_commit_for_its_peers(phases, Path(case.root) / "in-commit", world_size)
    error = None
    try:
        api.export_adapter(
            lambda: adapter_state(api, rank, 1, 1),
            dest,
            writer_rank=1,
            timeout_s=KILL_EXCHANGE_TIMEOUT_S,
            phases=phases,
        )
    except api.CollectiveExportError as err:
        error = str(err)
    leftovers = sorted(p.name for p in dest.parent.glob(f".{dest.name}.dsv4-*"))
    return {
        "error": error,
        "unchanged": snapshot_tree(dest) == before,
        "valid": validity(api, dest),
        "leftovers": leftovers,
    }


@pytest.mark.parametrize("writer_fails", [True, False], ids=["writer-fails", "writer-commits"])
def test_a_store_lost_inside_the_commit_leaves_each_survivor_saying_only_what_it_knows(
    impl, tmp_path: Path, writer_fails: bool
) -> None:
    """Rank 0 hosts the store and dies in the commit phase. The writer (rank 1) trusts its own commit: failed, it
    names its failure and rolls back (the earlier export stands); passed, it says the adapter WAS committed (the new
    export stands). The third rank, which can no longer learn the writer's outcome, says the destination is the new
    adapter or the earlier one, never a mix. No sidecar is left either way."""
    case = StoreHostCase(impl.name, str(tmp_path), writer_fails=writer_fails)
    survivors = survivors_of_a_kill(_rank_store_lost_inside_the_commit, case, nproc=3, killed=0)
    said = {r.rank: r.payload["error"] for r in survivors}
    for rank, error in said.items():
        assert error is not None, f"rank {rank} did not raise after the store's host died in the commit phase"
        assert "in phase commit" in error and "store host dead or hung" in error, f"rank {rank}: {error}"
    writer = next(r.payload for r in survivors if r.rank == 1)
    if writer_fails:
        assert "rank 1: OSError: commit rename failed" in said[1], said[1]
        assert "Nothing was published" in said[1] and "WAS committed" not in said[1], said[1]
    else:
        assert "WAS committed" in said[1], f"the writer denies its own commit: {said[1]}"
    assert writer["unchanged"] is writer_fails and writer["valid"] == "valid", f"the destination: {writer}"
    assert writer["leftovers"] == [], f"sidecars left next to the destination: {writer['leftovers']}"
    assert "never a mix" in said[2], f"rank 2 claims to know the writer's outcome: {said[2]}"
    assert "WAS committed" not in said[2] and "Nothing was published" not in said[2], said[2]


def test_without_a_process_group_the_export_is_rank_0_of_a_world_of_one(impl, tmp_path: Path) -> None:
    """Called in a process with no process group, the export is a world of one: that process writes the adapter,
    names itself rank 0 when a phase fails, and refuses any other writer rank."""
    out = tmp_path / "adapter"
    state = adapter_state(impl, 0, seed=0)
    assert str(impl.export_adapter(state, out, timeout_s=EXCHANGE_TIMEOUT_S)) == str(out)
    impl.validate_adapter_dir(out)
    failing = _failing_everywhere(impl.EXPORT_PHASES, "write", OSError("disk full"))
    with pytest.raises(impl.CollectiveExportError) as err:
        impl.export_adapter(state, tmp_path / "failing", timeout_s=EXCHANGE_TIMEOUT_S, phases=failing)
    assert "failed in phase write: rank 0: OSError: disk full" in str(err.value), str(err.value)
    with pytest.raises(impl.ExportError, match="writer_rank=1 is outside the world of 1 ranks"):
        impl.export_adapter(state, tmp_path / "elsewhere", writer_rank=1, timeout_s=EXCHANGE_TIMEOUT_S)


#: a hung rank answers this long after its phase began: past its peers' deadline (the kill tests' exchange timeout)
HANG_S = KILL_EXCHANGE_TIMEOUT_S + 1.5
#: a slow rank answers this long after its phase began: far longer than the store's own polling interval and than any
#: wait of a second or two (FileStore's wait, the file:// rendezvous, rounds its timeout up to the next whole second),
#: far inside the exchange timeout its peers wait with
SLOW_S = 3.5


def _failing_everywhere(phases, name: str, exc: BaseException):
    """``phases`` with ``name`` failing on every rank with the same ``exc`` (after its real work)."""

    def wrap(run):
        def failing(ctx) -> None:
            run(ctx)
            raise exc

        return failing

    return tuple((n, wrap(run) if n == name else run) for n, run in phases)


def _hanging_on(phases, name: str, rank: int, seconds: float = HANG_S):
    """``phases`` with ``name`` doing its real work on ``rank`` and then not answering for ``seconds``."""
    import torch.distributed as dist

    def wrap(run):
        def hanging(ctx) -> None:
            run(ctx)
            if dist.get_rank() == rank:
                time.sleep(seconds)

        return hanging

    return tuple((n, wrap(run) if n == name else run) for n, run in phases)


def _rank_export_outcomes(rank: int, world_size: int, case: OutcomeCase) -> dict[str, dict]:
    """One two-rank group, one export after the other to the same destination; what each rank saw of each."""
    api = load_impl(case.impl, prepare=False)
    dest = Path(case.root) / "adapter"
    seen: dict[str, dict] = {}
    refusals = (api.CollectiveExportError, api.ExportError)

    def attempt(label: str, alpha: float, **kwargs) -> None:
        settle_s = EXCHANGE_TIMEOUT_S + HANG_S  # the barrier after an export waits for a hung rank too
        seen[label] = export_attempt(api, rank, dest, alpha, catch=refusals, settle_s=settle_s, **kwargs)

    phases, quick = api.EXPORT_PHASES, {"timeout_s": EXCHANGE_TIMEOUT_S}
    attempt("first", 1.0, **quick)
    attempt("peer-fails", 2.0, phases=phases_with_fault(phases, "gather", 1, OSError("peer disk full")), **quick)
    attempt("every-rank-fails", 3.0, phases=_failing_everywhere(phases, "serialize", ValueError("same")), **quick)
    attempt("peer-fails-after-commit", 4.0, phases=phases_with_fault(phases, "commit", 1, OSError("late")), **quick)
    attempt("writer-is-rank-1", 5.0, writer_rank=1, **quick)
    attempt("writer-outside-the-world", 6.0, writer_rank=world_size, **quick)
    attempt("peer-slow", 6.5, phases=_hanging_on(phases, "write", 1, SLOW_S), **quick)
    hung = {"timeout_s": KILL_EXCHANGE_TIMEOUT_S}
    attempt("peer-hangs", 7.0, phases=_hanging_on(phases, "gather", 1), **hung)
    attempt("writer-hangs-after-commit", 8.0, phases=_hanging_on(phases, "commit", 0), **hung)
    return seen


def test_two_ranks_agree_on_every_outcome_of_an_export(impl, tmp_path: Path) -> None:
    """One fast two-rank group through the exporter's outcomes: a success on either writer, a peer's failure, the
    same failure on every rank, a peer failing after the commit point, a writer outside the world, a peer slower than
    the others but within the deadline, and a rank that hangs past its peers' deadline before and after the commit
    point. Every rank raises the same error naming each
    failing rank, except where a hung rank cannot know what its peer saw; it then learns that a peer aborted."""
    results = run_ranks(_rank_export_outcomes, OutcomeCase(impl.name, str(tmp_path)), nproc=2, timeout_s=120)
    ranks = [r.payload for r in results]

    def both(label: str) -> list[dict]:
        return [seen[label] for seen in ranks]

    def same_error(label: str) -> str:
        errors = [c["error"] for c in both(label)]
        assert errors[0] is not None and errors[0] == errors[1], f"{label}: the ranks raised {errors}"
        return errors[0]

    dest = str(tmp_path / "adapter")
    for c in both("first"):
        assert c["error"] is None and c["returned"] == dest and c["alpha"] == 1.0, f"first export: {c}"

    said = same_error("peer-fails")
    assert said.startswith("CollectiveExportError: ") and "failed in phase gather" in said, said
    assert "rank 1: OSError: peer disk full" in said and "rank 0:" not in said, said
    assert "Nothing was published and the destination is unchanged" in said, said
    assert all(c["unchanged"] and c["leftovers"] == [] for c in both("peer-fails")), both("peer-fails")

    said = same_error("every-rank-fails")
    assert "rank 0: ValueError: same" in said and "rank 1: ValueError: same" in said, said
    assert "failed in phase serialize" in said, said
    assert all(c["unchanged"] for c in both("every-rank-fails")), both("every-rank-fails")

    said = same_error("peer-fails-after-commit")
    assert "rank 1: OSError: late" in said and "failed in phase commit" in said, said
    assert "The new adapter WAS committed (rank 0 passed the commit point" in said, said
    assert "Nothing was published" not in said, said
    for c in both("peer-fails-after-commit"):
        assert c["alpha"] == 4.0 and c["leftovers"] == [], f"the committed export does not stand alone: {c}"

    for c in both("writer-is-rank-1"):
        assert c["error"] is None and c["returned"] == dest and c["alpha"] == 5.0, f"writer_rank=1: {c}"

    said = same_error("writer-outside-the-world")
    assert said == "ExportError: writer_rank=2 is outside the world of 2 ranks", said
    assert all(c["unchanged"] for c in both("writer-outside-the-world")), both("writer-outside-the-world")

    waited, hung = (c["error"] or "" for c in both("peer-hangs"))
    assert f"rank 1: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase gather (dead or hung)" in waited, waited
    assert "export aborted by a peer that timed out before phase gather" in hung, hung
    assert all("Nothing was published" in e for e in (waited, hung)), (waited, hung)
    assert all(c["unchanged"] for c in both("peer-hangs")), both("peer-hangs")

    for c in both("peer-slow"):
        assert c["error"] is None and c["alpha"] == 6.5, f"a peer slower than the others, within the deadline: {c}"

    hung, waited = (c["error"] or "" for c in both("writer-hangs-after-commit"))
    assert f"rank 0: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase commit" in waited, waited
    assert "stopped inside the commit" in waited and "never a mix" in waited, waited
    assert "aborted by a peer that timed out before phase commit" in hung and "WAS committed" in hung, hung
    for c in both("writer-hangs-after-commit"):
        assert c["alpha"] == 8.0 and c["leftovers"] == [], f"the committed export does not stand alone: {c}"
