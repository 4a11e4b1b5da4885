"""The export works whichever rank writes: a lost writer is stood in for by the lowest surviving rank alone, the
outcome is the same with any writer, and the protocol's own arguments (the phase table, the writer rank, how the
state and destination are passed) are refused or accepted before anything is written."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from fixtures.data.adapter_states import snapshot_tree
from fixtures.ranks.export_rank_fns import (
    EXCHANGE_TIMEOUT_S,
    KILL_EXCHANGE_TIMEOUT_S,
    PHASES,
    OutcomeCase,
    adapter_state,
    export_attempt,
    renamed_phases,
    survivors_of_a_kill,
    survivors_of_a_matrix_kill,
    validity,
)
from fixtures.ranks.faults import phases_with_fault
from fixtures.runner.impl_loader import load_impl
from fixtures.runner.multirank import run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]


@pytest.mark.parametrize(
    "phase,said,renamed",
    [
        pytest.param("publish", "Nothing was published", False, id="ws2-writer1-killed-after-publishing"),
        pytest.param("commit", "never a mix", True, id="ws2-writer1-killed-after-the-commit-point-renamed-phases"),
    ],
)
def test_a_lost_writer_other_than_rank_0_is_stood_in_for_by_the_lowest_surviving_rank(
    impl, tmp_path: Path, phase: str, said: str, renamed: bool
) -> None:
    """``writer_rank=1`` of two, killed after its phase's real work: rank 0, the lowest rank that is not the writer,
    raises the error naming the lost writer and restores the destination for it. Lost after publishing, the
    earlier export is back, complete and valid, and nothing was published; lost after the commit point, the new
    export stands valid and the error says it is the new export or the old one (told by the phase's name, here under
    a table whose names equal the protocol's but were built at run time). Either way no sidecar is left."""
    writer = 1
    (stand_in,) = survivors_of_a_matrix_kill(
        impl.name, tmp_path, 2, kill=(writer, phase), writer=writer, renamed=renamed
    )
    (c,) = stand_in.payload
    assert c["error"] is not None, f"rank 0 did not raise after the writer (rank {writer}) died in phase {phase}"
    lost = f"rank {writer}: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase {phase} (dead or hung)"
    assert lost in c["error"], f"rank 0 after the writer died in phase {phase}: {c['error']}"
    assert said in c["error"], f"rank 0 after the writer died in phase {phase}: {c['error']}"
    other = "never a mix" if said == "Nothing was published" else "Nothing was published"
    assert other not in c["error"], f"rank 0 after the writer died in phase {phase}: {c['error']}"
    assert c["leftovers"] == [], f"rank 0, the stand-in for the lost writer, left sidecars: {c['leftovers']}"
    assert c["valid"] == "valid", f"the destination does not validate after phase {phase}: {c['valid']}"
    if phase == "commit":
        assert not c["unchanged"], "the export the writer committed was rolled back"
    else:
        assert c["unchanged"], f"the stand-in did not restore the earlier export: {c['changed']}"


def _rank_export_beside_the_writer(rank: int, world_size: int, case: OutcomeCase) -> dict[str, dict]:
    """One two-rank group: a failure under writer rank 1, a peer lost after the commit point under a phase table
    whose names were built at run time, and a peer failing while its own view of the destination (a node-local
    disk) holds an interrupted export; what each rank saw of each."""
    api = load_impl(case.impl, prepare=False)
    root = Path(case.root)
    dest = root / "shared" / "adapter"
    own_view = root / f"rank{rank}-local" / "adapter"  # what this rank's own disk holds at the writer's path
    (own_view.parent / f".{own_view.name}.dsv4-staging").mkdir(parents=True)
    (own_view.parent / f".{own_view.name}.dsv4-staging" / "adapter_model.safetensors").write_bytes(b"interrupted")
    seen: dict[str, dict] = {}

    def attempt(label: str, alpha: float, **kwargs) -> None:
        seen[label] = export_attempt(
            api,
            rank,
            dest,
            alpha,
            catch=Exception,  # any error: judged by the test
            settle_s=EXCHANGE_TIMEOUT_S,
            own_view=own_view,
            timeout_s=EXCHANGE_TIMEOUT_S,
            **kwargs,
        )

    phases = api.EXPORT_PHASES
    attempt("first", 1.0)
    writer_fails = phases_with_fault(phases, "publish", 1, OSError("writer 1 cannot publish"), writer_rank=1)
    attempt("writer-1-fails-in-publish", 2.0, writer_rank=1, phases=writer_fails)
    late = renamed_phases(phases_with_fault(phases, "commit", 1, OSError("late")))
    attempt("renamed-phases-peer-fails-after-commit", 3.0, phases=late)
    peer_fails = phases_with_fault(phases, "gather", 1, OSError("peer disk full"))
    attempt("peer-with-its-own-view-fails", 4.0, out=dest if rank == 0 else own_view, phases=peer_fails)
    return seen


def test_the_outcome_of_an_export_does_not_depend_on_rank_0_being_the_writer_or_on_the_phase_names_identity(
    impl, tmp_path: Path
) -> None:
    """Two ranks: writer rank 1 failing to publish rolls back and both ranks raise its error saying nothing was
    published; a phase table whose names equal the protocol's but were built at run time still tells a peer lost
    after the commit point from a failed export (the adapter WAS committed); and a peer's failure while the writer
    is alive never has the peer touch its own view of the destination (on a node-local disk it holds other files)."""
    results = run_ranks(_rank_export_beside_the_writer, OutcomeCase(impl.name, str(tmp_path)), nproc=2, timeout_s=120)
    ranks = [r.payload for r in results]

    def both(label: str) -> list[dict]:
        return [seen[label] for seen in ranks]

    for c in both("first"):
        assert c["error"] is None and c["alpha"] == 1.0, f"first export: {c}"

    errors = [c["error"] for c in both("writer-1-fails-in-publish")]
    assert errors[0] is not None and errors[0] == errors[1], (
        f"writer_rank=1 failing in publish: the ranks raised {errors}"
    )
    said = errors[0]
    assert said.startswith("CollectiveExportError: ") and "failed in phase publish: rank 1: OSError" in said, said
    assert "Nothing was published and the destination is unchanged" in said, said
    for rank, c in enumerate(both("writer-1-fails-in-publish")):
        assert c["unchanged"] and c["alpha"] == 1.0, f"writer_rank=1 failing in publish: rank {rank} sees {c}"
        assert c["leftovers"] == [], f"writer_rank=1 failing in publish: rank {rank} sees sidecars {c['leftovers']}"

    errors = [c["error"] for c in both("renamed-phases-peer-fails-after-commit")]
    assert errors[0] is not None and errors[0] == errors[1], f"renamed phases, late peer: the ranks raised {errors}"
    said = errors[0]
    assert "rank 1: OSError: late" in said and "failed in phase commit" in said, said
    assert "The new adapter WAS committed (rank 0 passed the commit point" in said, said
    assert "Nothing was published" not in said, said
    for rank, c in enumerate(both("renamed-phases-peer-fails-after-commit")):
        assert c["alpha"] == 3.0 and c["leftovers"] == [], f"renamed phases, late peer: rank {rank} sees {c}"

    for rank, c in enumerate(both("peer-with-its-own-view-fails")):
        assert c["error"] is not None and "rank 1: OSError: peer disk full" in c["error"], f"rank {rank}: {c}"
        assert "Nothing was published" in c["error"], f"rank {rank}: {c['error']}"
        assert c["unchanged"] and c["alpha"] == 3.0, f"a peer's failure changed the destination (rank {rank}): {c}"
        assert c["view_unchanged"], f"rank {rank} touched its own view of the destination while the writer lived"


def _named(phases, names) -> tuple:
    runs = dict(phases)
    return tuple((name, runs.get(name, lambda ctx: None)) for name in names)


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(PHASES[:-1], id="commit-dropped"),
        pytest.param((*PHASES, "audit"), id="a-phase-added-at-the-end"),
        pytest.param(("serialize", "gather", *PHASES[2:]), id="gather-and-serialize-swapped"),
    ],
)
def test_a_phase_table_that_drops_adds_or_reorders_a_phase_is_refused_before_anything_is_written(
    impl, tmp_path: Path, names: tuple[str, ...]
) -> None:
    """The phase table a caller passes may wrap the protocol's phases, never change their names or order: any other
    table is an ExportError naming it, raised before the destination (or anything beside it) is touched."""
    out = tmp_path / "adapter"
    state = adapter_state(impl, 0, seed=0)
    with pytest.raises(impl.ExportError, match="a phase may be wrapped, never dropped, added or reordered") as err:
        impl.export_adapter(state, out, timeout_s=EXCHANGE_TIMEOUT_S, phases=_named(impl.EXPORT_PHASES, names))
    assert str(list(names)) in str(err.value), f"the error does not name the table {list(names)}: {err.value}"
    assert list(tmp_path.iterdir()) == [], f"the refused table {names} wrote {sorted(tmp_path.iterdir())}"


@pytest.mark.parametrize("writer_rank", [-1, 2])
def test_a_writer_rank_outside_the_world_is_refused_naming_it(impl, tmp_path: Path, writer_rank: int) -> None:
    """A world of one has rank 0 only: a negative writer rank, or one past the world, is refused before anything
    is written, not an export in which no rank writes."""
    state = adapter_state(impl, 0, seed=0)
    with pytest.raises(impl.ExportError, match=f"writer_rank={writer_rank} is outside the world of 1 ranks"):
        impl.export_adapter(state, tmp_path / "adapter", writer_rank=writer_rank, timeout_s=EXCHANGE_TIMEOUT_S)
    assert list(tmp_path.iterdir()) == [], f"writer_rank={writer_rank} wrote {sorted(tmp_path.iterdir())}"


def test_the_state_and_destination_are_passed_by_position_or_name_and_the_options_by_name_only(
    impl, tmp_path: Path
) -> None:
    """``export_adapter(adapter_phase=..., out_dir=...)`` exports; an option passed by position (here the writer
    rank) is a TypeError, never taken for another parameter."""
    out = tmp_path / "adapter"
    state = adapter_state(impl, 0, seed=0)
    assert str(impl.export_adapter(adapter_phase=state, out_dir=out, timeout_s=EXCHANGE_TIMEOUT_S)) == str(out)
    impl.validate_adapter_dir(out)
    with pytest.raises(TypeError):
        impl.export_adapter(state, tmp_path / "positional", 0)
    assert not (tmp_path / "positional").exists(), "an export with a positional option wrote its destination"


def _rank_export_with_a_lost_writer_and_local_views(rank: int, world_size: int, case: OutcomeCase) -> dict:
    """Three ranks, writer 0: an export to the shared destination, then one the writer dies in after publishing,
    to which rank 2 passes its own view of the destination (a node-local disk holding an interrupted export)."""
    import torch.distributed as dist

    api = load_impl(case.impl, prepare=False)
    root = Path(case.root)
    dest, own_view = root / "shared" / "adapter", root / f"rank{rank}-local" / "adapter"
    (own_view.parent / f".{own_view.name}.dsv4-staging").mkdir(parents=True)
    (own_view.parent / f".{own_view.name}.dsv4-staging" / "adapter_model.safetensors").write_bytes(b"interrupted")
    api.export_adapter(lambda: adapter_state(api, rank, 0), dest, timeout_s=EXCHANGE_TIMEOUT_S)
    dist.barrier(timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S))
    out = own_view if rank == 2 else dest
    before, view_before = snapshot_tree(dest), snapshot_tree(own_view)
    phases = phases_with_fault(api.EXPORT_PHASES, "publish", 0, None)  # the writer dies after publishing
    error = None
    try:
        api.export_adapter(lambda: adapter_state(api, rank, 1), out, timeout_s=KILL_EXCHANGE_TIMEOUT_S, phases=phases)
    except api.CollectiveExportError as err:
        error = str(err)
    valid = validity(api, dest)
    return {
        "error": error,
        "unchanged": before == snapshot_tree(dest),
        "view_unchanged": view_before == snapshot_tree(own_view),
        "valid": valid,
        "leftovers": sorted(p.name for p in dest.parent.glob(f".{dest.name}.dsv4-*")),
    }


def test_only_the_lowest_surviving_rank_stands_in_for_a_lost_writer(impl, tmp_path: Path) -> None:
    """Three ranks, the writer (rank 0) killed after publishing: rank 1, the lowest survivor, restores the earlier
    export (complete, valid, no sidecar left), and rank 2 leaves its own view of the destination alone (on a
    node-local disk it holds other files): one rank stands in, never every survivor."""
    stand_in, other = survivors_of_a_kill(
        _rank_export_with_a_lost_writer_and_local_views, OutcomeCase(impl.name, str(tmp_path)), nproc=3, killed=0
    )
    for r in (stand_in, other):
        said = r.payload["error"]
        assert said is not None, f"rank {r.rank} did not raise after the writer (rank 0) died in phase publish"
        assert f"rank 0: no response within {KILL_EXCHANGE_TIMEOUT_S:g}s in phase publish" in said, said
        assert "Nothing was published" in said, f"rank {r.rank}: {said}"
    c = stand_in.payload
    assert c["unchanged"] and c["valid"] == "valid", f"rank 1 did not restore the earlier export: {c}"
    assert c["leftovers"] == [], f"rank 1, the stand-in for the lost writer, left sidecars: {c['leftovers']}"
    assert other.payload["view_unchanged"], "rank 2, not the stand-in, touched its own view of the destination"
