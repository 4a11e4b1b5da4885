"""A failure on any rank, at any step of the export, fails every rank in time and publishes nothing.

Faults go where every Python implementation's export goes (``fixtures/conformance/seams.py``): each file operation
the implementation was seen to make under the destination (``mkdir``, ``open``, ``write``, a short write, ``fsync``,
a rename, ``torch.save``, safetensors' writer) fails with ``ENOSPC`` on the rank that made it; one rank's gather
raises after its first collective; a NaN sits in one rank's adapter; a rank is killed. Judged: every surviving rank
raises within the export's timeout, naming the failing rank or the cause; after an error the directory holding the
destination is byte for byte what it was (an earlier export intact, no partial file, no success marker, nothing left
beside it); after a kill the destination holds the earlier export or a complete new one, never a mix.
"""

from __future__ import annotations

import signal

import pytest

from dsv4_conformance.driver import Layout, LoraSpec
from dsv4_conformance.judge.artifacts import judge_adapter_dir
from fixtures.conformance.programs import FaultCase, export_faults, export_killed, read_progress
from fixtures.conformance.seams import FILE_OPS, INJECTED, Fault
from fixtures.runner.multirank import MultiRankFailure, RankFailure

#: every test here reads the one faults run (or waits on it): one worker runs them all (``--dist loadgroup``)
FAULTS_GROUP = pytest.mark.xdist_group("conformance-faults")
pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.needs("build", "train_step", "export"), FAULTS_GROUP]

#: tensor parallel, so the adapter is sharded and the export must gather it
LAYOUT = Layout(tp=2, collective_timeout_s=10.0)
TIMEOUT_S = 20.0
#: what a rank may take beyond the export's timeout to notice a peer that failed inside a collective
SLACK_S = LAYOUT.collective_timeout_s + 10.0
NAN_RANKS = (0, 1)


@pytest.fixture(scope="module")
def faults(drive, driver_name, conformance_base, tmp_path_factory):
    """Every discovered fault, one export each, in one run; what each rank filed, also when the run broke down."""
    root = tmp_path_factory.mktemp("faults")
    case = FaultCase(driver_name, str(conformance_base), str(root), LAYOUT, LoraSpec(), None, NAN_RANKS, TIMEOUT_S)
    breakdown = ""
    try:
        drive(export_faults, case, timeout_s=240)
    except MultiRankFailure as failure:
        breakdown = " ".join(str(failure).splitlines()[:3])[:600]
    progress = read_progress(str(root))
    labels = list(dict.fromkeys(run.fault for runs in progress.runs for run in runs))
    runs = {
        label: [next((r for r in rank_runs if r.fault == label), None) for rank_runs in progress.runs]
        for label in labels
    }
    return {"ops": progress.ops, "runs": runs, "in_flight": set(progress.in_flight) - {None}, "breakdown": breakdown}


def _runs(faults: dict, label_start: str, label_end: str = "") -> tuple[str, list]:
    """The label and per-rank runs of the fault whose label starts (and ends) so; a fault the run broke down in, or
    never reached because it broke down earlier, fails naming the breakdown."""
    __tracebackhide__ = True
    hits = [label for label in faults["runs"] if label.startswith(label_start) and label.endswith(label_end)]
    for label in hits:
        if all(faults["runs"][label]):
            return label, faults["runs"][label]
    flight = [label for label in faults["in_flight"] if label.startswith(label_start) and label.endswith(label_end)]
    if flight or hits:
        pytest.fail(f"{(flight or hits)[0]}: the ranks broke down during this export: {faults['breakdown']}")
    if faults["breakdown"]:
        pytest.fail(f"{label_start}...: not reached, the run broke down before it: {faults['breakdown']}")
    return "", []


def _writer(ops: list[list[str]]) -> int:
    """The first rank seen writing under the destination."""
    return next((r for r, seen in enumerate(ops) if {"open", "safetensors", "torch.save"} & set(seen)), 0)


def _judge_failed(label: str, runs: list, failing_rank: int | None, cause_words: tuple[str, ...]) -> None:
    """Every rank raised in time naming the failing rank or the cause, and nothing under the root changed."""
    __tracebackhide__ = True
    for rank, run in enumerate(runs):
        assert run.error, f"{label}: rank {rank} returned from the export as if it had succeeded"
        assert run.elapsed <= TIMEOUT_S + SLACK_S, f"{label}: rank {rank} took {run.elapsed:.1f}s to fail"
        text = run.error.lower()
        named = any(w in text for w in cause_words) or (failing_rank is not None and f"rank {failing_rank}" in text)
        assert named, f"{label}: rank {rank}'s error names neither rank {failing_rank} nor the cause: {run.error}"
    before, after = runs[0].before, runs[0].after
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"{label}: the directory holding the destination changed: {changed[:6]}"


def _judge_recovered_or_failed(label, runs, failing_rank, cause_words, base, marker, scratch) -> None:
    """A failure the implementation recovered from is no defect when every rank returned and the destination holds
    a valid adapter; otherwise :func:`_judge_failed`."""
    __tracebackhide__ = True
    if any(run.error for run in runs):
        _judge_failed(label, runs, failing_rank, cause_words)
        return
    dest = runs[0].dest
    for name, data in runs[0].after.items():
        if name.startswith(f"{dest}/"):
            path = scratch / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    problems = judge_adapter_dir(scratch / dest, base, marker=marker)
    assert not problems, f"{label}: every rank returned, but the destination is not a valid adapter: {problems[0]}"


def test_the_export_writes_under_its_destination(faults):
    assert faults["ops"] is not None, f"the first, fault-free export did not finish: {faults['breakdown']}"
    assert any(faults["ops"]), "no rank was seen creating or writing a file under the destination"


@pytest.mark.parametrize("op", FILE_OPS)
def test_a_failing_file_operation_fails_every_rank_and_changes_nothing(faults, op, conformance_base, driver, tmp_path):
    seen_as = {"short-write": ("write", "safetensors")}.get(op, (op,))
    if faults["ops"] is not None and not any(o in ops for ops in faults["ops"] for o in seen_as):
        pytest.skip(f"the implementation does no {op} under the destination (seen: {faults['ops']})")
    for into in ("existing", "fresh"):
        label, runs = _runs(faults, f"fail {op} on rank ", f" into {into}")
        if not label:
            pytest.skip(f"the implementation does no {op} under the destination (seen: {faults['ops']})")
        assert any(r.fired for r in runs), f"{label}: the fault never fired"
        failing = int(label.split(" on rank ")[1].split()[0])
        cause = (INJECTED, "no space left")
        scratch = tmp_path / into
        _judge_recovered_or_failed(label, runs, failing, cause, conformance_base, driver.success_marker, scratch)


@pytest.mark.needs("adapter_parameters")
@pytest.mark.parametrize("rank", NAN_RANKS)
def test_a_nan_in_one_ranks_adapter_fails_every_rank_and_changes_nothing(faults, rank):
    label, runs = _runs(faults, "NaN in ", f"on rank {rank}")
    _judge_failed(label, runs, None, ("nan", "finite"))


def _killed(drive, driver_name, conformance_base, tmp_path, fault: Fault, expect=None):
    case = FaultCase(driver_name, str(conformance_base), str(tmp_path), LAYOUT, LoraSpec(), (fault,), (), TIMEOUT_S)
    return drive(export_killed, case, timeout_s=300, expect=expect, grace_s=TIMEOUT_S + SLACK_S)


def test_a_gather_failing_on_one_rank_fails_every_rank_and_changes_nothing(
    drive, driver_name, conformance_base, tmp_path
):
    payloads = _killed(drive, driver_name, conformance_base, tmp_path, Fault("collective", 1))
    runs = [p["run"] for p in payloads]
    assert runs[1].fired, "rank 1 ran no collective during the export, so its gather never failed"
    _judge_failed("gather fails on rank 1", runs, 1, (INJECTED,))


@pytest.mark.parametrize("who", ["writer", "peer"])
def test_a_rank_killed_during_the_export_fails_every_survivor(
    faults, drive, driver_name, conformance_base, tmp_path, who
):
    if faults["ops"] is None:
        pytest.fail(f"the first, fault-free export did not finish: {faults['breakdown']}")
    writer = _writer(faults["ops"])
    rank = writer if who == "writer" else 1 - writer
    op = (
        next((o for o in ("mkdir", "open", "safetensors") if o in faults["ops"][writer]), "open")
        if who == "writer"
        else "collective"
    )
    fault = Fault(op, rank, kill=True)
    payloads = _killed(
        drive, driver_name, conformance_base, tmp_path, fault, RankFailure(rank=rank, signal=signal.SIGKILL)
    )
    (survivor,) = [p["run"] for r, p in enumerate(payloads) if r != rank and p is not None]
    assert survivor.error, f"{fault}: the survivor returned from the export as if it had succeeded"
    assert survivor.elapsed <= TIMEOUT_S + SLACK_S, f"{fault}: the survivor took {survivor.elapsed:.1f}s to fail"
    assert f"rank {rank}" in survivor.error.lower(), (
        f"{fault}: the survivor's error does not name rank {rank}: {survivor.error}"
    )
    dest = tmp_path / "existing"
    before = {k: v for k, v in survivor.before.items() if k.startswith("existing/")}
    after = {k: v for k, v in survivor.after.items() if k.startswith("existing/")}
    if after != before:
        problems = judge_adapter_dir(dest, conformance_base)
        assert not problems, (
            f"{fault}: the destination is neither the earlier export nor a valid new one: {problems[0]}"
        )
