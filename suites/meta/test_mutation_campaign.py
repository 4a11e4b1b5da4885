"""The mutation campaign's record stays honest: every reviewed decision is about a survivor the committed report
lists (no decision outlives its mutant), the report shows each survivor's decision, and the campaign leaves out
only what it says it leaves out (annotations, the operators outside the selective set)."""

from __future__ import annotations

import pytest

from fixtures.mutations.campaign import (
    MODULES,
    annotation_spans,
    changed_lines,
    decisions,
    excluded_operator,
    in_annotation,
)
from fixtures.mutations.campaign_report import (
    FIRST_FAILURE,
    REPORT,
    campaigned,
    killed_before,
    listed_survivors,
    recorded_seconds,
)

pytestmark = pytest.mark.cpu


def test_every_decision_is_about_a_survivor_the_report_lists():
    stale = sorted(set(decisions()) - listed_survivors())
    assert not stale, f"decisions for mutants the report does not list (rerun the campaign or drop them): {stale}"


def test_the_report_shows_each_decided_survivor_with_its_verdict():
    text = REPORT.read_text()
    for (module, before, after), decision in decisions().items():
        assert decision.why and decision.why in text, f"{module}: {before} -> {after}: its reason is not in the report"


def test_the_report_covers_the_campaign_modules_and_some_were_run():
    named = {m.path for m in MODULES}
    assert campaigned() and campaigned() <= named, f"campaigned {sorted(campaigned())} of {sorted(named)}"


def test_only_annotations_and_the_excluded_operators_are_skipped():
    source = "from __future__ import annotations\n\ndef f(x: int | None, y=1 | 2) -> str | None:\n    return x\n"
    spans = annotation_spans(source)
    assert in_annotation((3, 11), spans) and in_annotation((3, 35), spans), spans  # int | None, str | None
    assert not in_annotation((3, 23), spans), "the default 1 | 2 is evaluated: a mutant there is no annotation's"
    assert excluded_operator("core/ReplaceBinaryOperator_Add_LShift") is not None
    assert excluded_operator("core/ReplaceBinaryOperator_Add_Sub") is None
    assert excluded_operator("core/ReplaceComparisonOperator_Eq_NotEq") is None


def test_a_diff_names_the_original_and_the_mutated_line():
    diff = "--- mutation diff ---\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-    if a == b:\n+    if a != b:\n"
    assert changed_lines(diff) == ("if a == b:", "if a != b:")


TOY_BEFORE = """def f(a, b):
    return a + b < 3


def g(a):
    return a + 1
"""
# new lines at the top move every position; f gains a site (g's + is the next occurrence now) and keeps its columns;
# g is left alone
TOY_AFTER = """LIMIT = 2


def f(a, b):
    return a + a + b < 3


def g(a):
    return a + 1
"""


def _list_and_record(tmp_path, text: str, outcome: str):
    """A session of cosmic-ray's own listing of ``text``, each mutant recorded as ``outcome`` with its real diff."""
    import cosmic_ray.plugins
    from cosmic_ray.commands import init
    from cosmic_ray.mutating import _make_diff, use_mutation
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    tmp_path.mkdir()
    module = tmp_path / "toy.py"
    module.write_text(text)
    session = tmp_path / "toy.sqlite"
    with use_db(str(session), WorkDB.Mode.create) as db:
        init([module], db, {})
        for item in list(db.pending_work_items):
            mutation = item.mutations[0]
            operator = cosmic_ray.plugins.get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
            with use_mutation(module, operator, mutation.occurrence) as (before, after):
                diff = "\n".join(_make_diff(before, after, module)) if after is not None else ""
            db.set_result(
                item.job_id,
                WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome(outcome), diff=diff),
            )
    return module, session


def test_a_refreshed_session_keeps_a_result_only_for_the_very_same_mutant(tmp_path):
    """After a change, every carried result's diff is the diff its new mutant makes (same site, same change); the
    mutants of the changed line run again, those of the untouched function are all carried."""
    import sqlite3

    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db

    from fixtures.mutations.campaign_refresh import CARRIED, refresh

    _, session = _list_and_record(tmp_path / "old", TOY_BEFORE, "killed")
    _, fresh = _list_and_record(tmp_path / "new", TOY_AFTER, "survived")  # the diffs the new listing makes

    def relist(path):
        with use_db(str(path), WorkDB.Mode.create) as db:
            init([tmp_path / "new" / "toy.py"], db, {})

    said = refresh(session, TOY_BEFORE, TOY_AFTER, relist)
    query = (
        "SELECT s.operator_name, s.occurrence, s.start_pos_row, r.diff, r.output FROM mutation_specs s "
        "JOIN work_results r ON s.job_id = r.job_id"
    )
    with sqlite3.connect(session) as db, sqlite3.connect(fresh) as want_db:
        carried = db.execute(query).fetchall()
        want = {(op, n): changed_lines(diff) for op, n, _, diff, _ in want_db.execute(query)}
        listed = db.execute("SELECT count(*) FROM mutation_specs").fetchone()[0]
    assert carried and all(output.startswith(CARRIED) for *_, output in carried), said
    for op, n, row, diff, _ in carried:
        assert changed_lines(diff) == want[(op, n)], f"{op} #{n} (line {row}) carried another mutant's result"
        assert row >= 8, f"{op} #{n}: line {row} of the changed f was carried"
    g_sites = sum(1 for (op, n), (before, _) in want.items() if before == "return a + 1")
    assert len(carried) == g_sites < listed, f"{said}: carried {len(carried)}, g has {g_sites} mutants"


def test_every_test_a_campaign_row_names_is_collected():
    """A row naming a test that was renamed or moved runs fewer tests than it says: its mutants would survive on a
    missing test (pytest's 'not found' is an error, not a pass, but only once the row runs)."""
    import subprocess
    import sys

    ids = sorted({test for module in MODULES for test in module.tests})
    args = [sys.executable, "-m", "pytest", "-m", "cpu", "--collect-only", "-q", "-p", "no:randomly", *ids]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    missing = [line for line in (result.stdout + result.stderr).splitlines() if "not found" in line]
    assert result.returncode == 0 and not missing, missing or result.stdout[-2000:]


def test_every_recorded_time_is_of_a_campaign_module():
    known = {m.path for m in MODULES}
    stray = sorted(set(recorded_seconds()) - known)
    assert not stray, f"campaign_times.toml records runs of modules the campaign does not have: {stray}"


def test_a_kill_counts_as_before_only_when_its_first_failing_test_is_an_old_one():
    old = frozenset({"test_old"})
    tail = "=== short test summary info ===\nFAILED suites/x.py::{}[p1] - AssertionError\n1 failed in 2s"
    assert killed_before(tail.format("test_old"), old)
    assert not killed_before(tail.format("test_new"), old)
    assert FIRST_FAILURE.search("ERROR suites/x.py::test_new - fixture").group(1) == "test_new"
    assert killed_before("timed out after 300s", old), "a hang is noticed by any run"
