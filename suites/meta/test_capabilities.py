"""Capabilities: every suite file belongs to exactly one (``fixtures/contract/capabilities.py``), and an implementation that
declares some has the tests of the others skipped with the reason, never passed."""

from __future__ import annotations

import sys
import types

import pytest

from fixtures.contract.capabilities import (
    BY_NAME,
    CAPABILITIES,
    CAPABILITY_DOC,
    HARNESS,
    capability_of,
    render_capabilities,
    skip_undeclared,
    suite_files,
)
from fixtures.runner.subproc import REPO_ROOT, pytest_outcomes, run

pytestmark = pytest.mark.cpu


def _rows_holding(path: str) -> list[str]:
    return [c.name for c in CAPABILITIES if c.holds(path)]


def test_every_suite_file_is_in_exactly_one_capability():
    wrong = {path: rows for path in suite_files() if len(rows := _rows_holding(path)) != 1}
    assert not wrong, "suite files in no capability or in several (fixtures/contract/capabilities.py): " + repr(wrong)


def test_every_file_a_capability_names_exists():
    missing = [f"{c.name}: {f}" for c in CAPABILITIES for f in c.files if not (REPO_ROOT / f).exists()]
    assert not missing, f"capabilities name files that do not exist: {missing}"


def test_the_documented_capabilities_are_the_table():
    CAPABILITY_DOC.assert_current(
        render_capabilities(), what="capabilities table", source="fixtures/contract/capabilities.py"
    )


def test_the_row_check_sees_a_file_in_no_row_and_one_in_two():
    """The two checks above on a deliberate violation: a new suite file nobody filed, and a folder row over a file."""
    assert _rows_holding("suites/reference/test_nobody_filed.py") == []
    assert capability_of("suites/reference/test_nobody_filed.py") is None
    assert _rows_holding("suites/meta/test_docs.py") == [HARNESS]


class _Item:
    """Just enough of ``pytest.Item`` for :func:`skip_undeclared`: a node id and the markers added to it."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.markers = nodeid, []

    def add_marker(self, marker) -> None:
        self.markers.append(marker)


def _fake_impl(monkeypatch, capabilities) -> str:
    module = types.ModuleType("fake_partial_impl")
    if capabilities is not None:
        module.CAPABILITIES = capabilities
    monkeypatch.setitem(sys.modules, "fake_partial_impl", module)
    return "fake_partial_impl"


def test_an_undeclared_capabilitys_tests_are_skipped_naming_it(monkeypatch):
    name = _fake_impl(monkeypatch, frozenset({"export"}))
    declared, other, harness = (
        _Item(f"{f}::test_x")
        for f in (BY_NAME["export"].files[0], "suites/reference/test_cli.py", "suites/meta/test_docs.py")
    )
    skip_undeclared(name, [declared, other, harness])
    assert declared.markers == [] and harness.markers == [], "a declared capability and the harness always run"
    [mark] = other.markers
    assert mark.name == "skip"
    assert mark.kwargs["reason"] == "fake_partial_impl does not declare capability 'cli'; it declares ['export']"


def test_an_implementation_declaring_nothing_claims_everything(monkeypatch):
    items = [_Item(f"{f}::test_x") for c in CAPABILITIES for f in c.files if not f.endswith("/")]
    skip_undeclared(_fake_impl(monkeypatch, None), items)
    assert not [i.nodeid for i in items if i.markers]


def test_an_unknown_capability_is_a_usage_error_listing_the_known_ones(monkeypatch):
    name = _fake_impl(monkeypatch, frozenset({"export", "exporting"}))
    with pytest.raises(pytest.UsageError, match=r"\['exporting'\], which are not capabilities; the capabilities are"):
        skip_undeclared(name, [_Item("suites/reference/test_cli.py::test_x")])


def test_the_conftest_skips_undeclared_tests_in_a_real_run(tmp_path):
    """Under a copy of this repository's conftest, a partial implementation's run: its capability's test passes,
    another capability's is SKIPPED with the reason, none of them passes unjudged."""
    import shutil

    shutil.copy(REPO_ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    (tmp_path / "exporter_only.py").write_text("CAPABILITIES = frozenset({'export'})\n")
    (tmp_path / "suites" / "reference").mkdir(parents=True)
    test = "import pytest\n\npytestmark = pytest.mark.cpu\n\n\ndef test_it():\n    pass\n"
    for path in ("suites/reference/test_export_format.py", "suites/reference/test_cli.py"):
        (tmp_path / path).write_text(test)
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-rA", "--impl", "exporter_only", "suites"]
    result = run(argv, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    out = result.stdout + result.stderr
    assert pytest_outcomes(out) == {"suites/reference/test_export_format.py::test_it": "PASSED"}, out[-4000:]
    skipped = "SKIPPED [1] suites/reference/test_cli.py: exporter_only does not declare capability 'cli'; it declares ['export']"
    assert skipped in out, out[-4000:]
    assert "1 passed, 1 skipped" in out and result.returncode == 0, out[-4000:]
