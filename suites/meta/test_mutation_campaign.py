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
from fixtures.mutations.campaign_report import REPORT, campaigned, listed_survivors

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
