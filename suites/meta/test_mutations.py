"""The mutation catalogue (fixtures/mutations/__init__.py) stays honest without running it.

Every row still applies exactly once to the implementation as it is (a moved code path fails the normal suite, not
only ``scripts/mutation_check.py``), its mutated file still compiles, and the tests it names exist; every claim is
attacked or says why not; the README's failure-mode table and the catalogue's claims name the same rows.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fixtures.mutations import CATALOGUE, CLAIMS, UNATTACKED, Seeded, Source, change_problem
from fixtures.runner.impl_copy import REPO_ROOT, SOURCE_PACKAGE, TextMutation

pytestmark = pytest.mark.cpu

_NAME = re.compile(r"[a-z0-9]+(?:[-_][a-z0-9]+)*")


def _row_problems(entry: Seeded, package_dir: Path, root: Path) -> list[str]:
    problems = []
    if not _NAME.fullmatch(entry.name):
        problems.append(f"{entry.name!r}: a mutation name is lower-case words joined by '-'")
    if entry.attacks not in CLAIMS:
        problems.append(f"{entry.name}: attacks {entry.attacks!r}, which is not a key of CLAIMS")
    if not isinstance(entry.change, TextMutation) or entry.change.old == entry.change.new or not entry.why:
        problems.append(f"{entry.name}: needs a TextMutation that changes something, and a 'why'")
    if not entry.kill or entry.k == "":
        problems.append(f"{entry.name}: names no test to kill it (or an empty -k)")
    if (why := change_problem(entry, package_dir)) is not None:
        return [*problems, why]
    path = package_dir / entry.change.file
    try:
        compile(path.read_text().replace(entry.change.old, entry.change.new), str(path), "exec")
    except SyntaxError as exc:
        problems.append(
            f"{entry.name}: the mutated {entry.change.file} does not compile ({exc.msg}, line {exc.lineno})"
        )
    return problems + [p for target in entry.kill if (p := _missing_test(target, root))]


def _missing_test(target: str, root: Path) -> str | None:
    """Why ``target`` (a test file, or ``file::test`` / ``file::Class::test`` with an optional ``[param]``) names
    nothing in the suite as it is."""
    file, *names = target.split("::")
    path = root / file
    if not path.is_file():
        return f"{target}: no such test file"
    defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if hasattr(node, "name")}
    missing = [n for n in (name.split("[")[0] for name in names) if n not in defined]
    return f"{target}: {file} defines no {missing[0]}" if missing else None


def test_every_catalogue_row_applies_exactly_once_and_names_existing_tests():
    package_dir = REPO_ROOT / SOURCE_PACKAGE
    problems = [p for entry in CATALOGUE for p in _row_problems(entry, package_dir, REPO_ROOT)]
    assert not problems, "mutation catalogue rows that no longer hold:\n  " + "\n  ".join(problems)
    names = [e.name for e in CATALOGUE]
    assert len(names) == len(set(names)), (
        f"duplicate mutation names: {sorted({n for n in names if names.count(n) > 1})}"
    )
    assert len(CATALOGUE) >= 20, f"{len(CATALOGUE)} mutations; the catalogue promises at least 20"


def test_every_claim_is_attacked_or_says_why_not():
    attacked = {e.attacks for e in CATALOGUE}
    silent = sorted(set(CLAIMS) - attacked - set(UNATTACKED))
    assert not silent, f"claims no mutation attacks and UNATTACKED does not explain: {silent}"
    stale = sorted(set(UNATTACKED) & attacked)
    assert not stale, f"claims listed as unattacked although a mutation attacks them (remove them): {stale}"
    unknown = sorted(set(UNATTACKED) - set(CLAIMS))
    assert not unknown and all(UNATTACKED.values()), f"UNATTACKED names unknown claims {unknown} or gives no reason"


def readme_failure_modes(readme: str) -> list[str]:
    """First column of the README's failure-mode table (the table whose header starts with ``| failure mode``)."""
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| failure mode |")), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def test_the_readme_failure_modes_are_the_catalogues_claims():
    table = readme_failure_modes((REPO_ROOT / "README.md").read_text())
    claims = [c.text for c in CLAIMS.values() if c.source is Source.README_FAILURE_MODES]
    assert table, "README.md has no failure-mode table ('| failure mode | ...')"
    assert sorted(table) == sorted(claims), (
        f"README rows without a claim: {sorted(set(table) - set(claims))}; "
        f"claims without a README row: {sorted(set(claims) - set(table))}"
    )


# --- the checks above can fail ----------------------------------------------------------------------------------


_EXAMPLE_MODULE = 'NAME = "value"\nOTHER = NAME\n'
_EXAMPLE_TESTS = "def test_present():\n    pass\n"


def _row(*, file="mod.py", old='NAME = "value"', new="NAME = None", kill="suites/test_x.py::test_present", **kw):
    fields = {"attacks": "exact-detection", "why": "an example", **kw}
    return Seeded("example-row", change=TextMutation(file, old, new), kill=(kill,), **fields)


BROKEN_ROWS = {
    "code-moved": (_row(old="no such text"), "occurs 0 times, expected exactly once"),
    "text-twice": (_row(old="NAME"), "occurs 2 times"),
    "file-gone": (_row(file="gone.py"), "does not exist"),
    "does-not-compile": (_row(new="NAME = ("), "does not compile"),
    "test-renamed": (_row(kill="suites/test_x.py::test_gone[param]"), "defines no test_gone"),
    "test-file-gone": (_row(kill="suites/test_y.py"), "no such test file"),
    "unknown-claim": (_row(attacks="no-such-claim"), "not a key of CLAIMS"),
    "no-reason": (_row(why=""), "a 'why'"),
}


@pytest.mark.parametrize(("entry", "needle"), BROKEN_ROWS.values(), ids=list(BROKEN_ROWS))
def test_a_broken_row_is_reported(tmp_path, entry, needle):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(_EXAMPLE_MODULE)
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "test_x.py").write_text(_EXAMPLE_TESTS)
    assert _row_problems(_row(), tmp_path / "pkg", tmp_path) == [], "the example row itself must be sound"
    problems = _row_problems(entry, tmp_path / "pkg", tmp_path)
    assert any(needle in p for p in problems), f"{needle!r} not reported: {problems}"


def test_the_failure_mode_table_is_read_to_its_last_row():
    readme = "intro\n\n| failure mode | proof |\n|---|---|\n| one | a |\n| two | b |\n\nmore\n| x | y |\n"
    assert readme_failure_modes(readme) == ["one", "two"]


_JUNIT = """<testsuites><testsuite>
<testcase classname="suites.reference.test_cli" name="test_default_qualify_passes[tp1]@cli" time="30.5" />
<testcase classname="suites.reference.test_cli" name="test_default_qualify_passes[tp2]@cli" time="40.0">
  <failure message="boom" /></testcase>
<testcase classname="suites.reference.test_cli" name="test_skipped" time="0.1"><skipped /></testcase>
<testcase classname="suites.reference.test_cli" name="test_setup_broke" time="2.0"><error /></testcase>
<testcase classname="suites.meta.test_mutations" name="test_fast" time="0.5" />
<testcase classname="suites.meta.test_mutations" name="test_torn_down_badly" time="0.5" />
<testcase classname="suites.meta.test_mutations" name="test_torn_down_badly" time="0.0"><error /></testcase>
<testcase classname="suites.meta.test_mutations.TestInside" name="test_in_a_class" time="1.0" />
</testsuite></testsuites>"""


def test_an_earlier_run_proves_only_what_passed_there_and_orders_rows_longest_first(tmp_path):
    """The mutation check's ``--earlier-run``: a node that failed, errored or was skipped there still needs its
    control run, and so does one recorded twice whose teardown errored; xdist's ``@group`` suffix and test classes
    map to the node ids the kill runs report."""
    from fixtures.mutations.earlier_run import read_earlier_run

    (tmp_path / "suites" / "reference").mkdir(parents=True)
    (tmp_path / "suites" / "meta").mkdir()
    for f in ("suites/reference/test_cli.py", "suites/meta/test_mutations.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "run.xml").write_text(_JUNIT)
    run = read_earlier_run(tmp_path / "run.xml", tmp_path)
    assert run.passed == {
        "suites/reference/test_cli.py::test_default_qualify_passes[tp1]",
        "suites/meta/test_mutations.py::test_fast",
        "suites/meta/test_mutations.py::TestInside::test_in_a_class",
    }
    qualify = "suites/reference/test_cli.py::test_default_qualify_passes"
    assert run.estimate((qualify,), None) == 70.5 and run.estimate((qualify,), "tp2") == 40.0
    assert run.estimate(("suites/meta/test_mutations.py",), None) == 2.0
    assert run.estimate(("suites/reference/test_cli.py::test_default",), None) is None  # a prefix of a name is not
    rows = [
        Seeded("fast", "x", TextMutation("a.py", "a", "b"), ("suites/meta/test_mutations.py::test_fast",), why="."),
        Seeded("unknown", "x", TextMutation("a.py", "a", "b"), ("suites/x.py",), why="."),
        Seeded("slow", "x", TextMutation("a.py", "a", "b"), (qualify,), why="."),
        Seeded("middle", "x", TextMutation("a.py", "a", "b"), ("suites/meta/test_mutations.py",), why="."),
    ]
    assert [r.name for r in run.longest_first(rows)] == ["slow", "unknown", "middle", "fast"]  # unknown: the median
