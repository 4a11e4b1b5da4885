"""The harness is in rooms: ``fixtures/`` holds packages by concern (no loose modules), each saying what it holds,
and a rank-function module that only one suite uses is named for that suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

#: what may sit in fixtures/ beside the packages: its marker, and the stand-in tree that hides megatron
LOOSE_ALLOWED = frozenset({"__init__.py", "no_megatron"})
RANK_MODULE = re.compile(r"^(\w+)_rank_fns\.py$")


def loose_entries(fixtures: Path) -> list[str]:
    return sorted(
        p.name
        for p in fixtures.iterdir()
        if p.name not in LOOSE_ALLOWED and p.name != "__pycache__" and not (p / "__init__.py").is_file()
    )


def undocumented_packages(fixtures: Path) -> list[str]:
    return sorted(
        p.name
        for p in fixtures.iterdir()
        if (p / "__init__.py").is_file() and not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))
    )


def misnamed_rank_modules(root: Path) -> list[str]:
    """Rank-function modules used by exactly one suite file whose name is not that suite's (``test_x.py`` ->
    ``x_rank_fns.py``), and ones no suite uses."""
    wrong = []
    suites = {p: p.read_text() for p in sorted((root / "suites").rglob("test_*.py"))}
    for module in sorted((root / "fixtures" / "ranks").glob("*_rank_fns.py")):
        users = [p for p, text in suites.items() if re.search(rf"\b{module.stem}\b", text)]
        if not users:
            wrong.append(f"{module.name}: no suite uses it")
        elif len(users) == 1 and module.stem != users[0].stem.removeprefix("test_") + "_rank_fns":
            wrong.append(f"{module.name}: only {users[0].name} uses it; name it for that suite")
    return wrong


def test_fixtures_holds_only_packages_by_concern():
    loose = loose_entries(REPO_ROOT / "fixtures")
    assert not loose, f"modules loose in fixtures/ (put each in the package of its concern): {loose}"
    assert not undocumented_packages(REPO_ROOT / "fixtures"), (
        "fixtures/ packages without a docstring saying what they hold"
    )


def test_a_rank_module_used_by_one_suite_is_named_for_it():
    wrong = misnamed_rank_modules(REPO_ROOT)
    assert not wrong, "rank-function modules:\n  " + "\n  ".join(wrong)


def test_the_room_checks_see_a_loose_module_a_silent_package_and_a_misnamed_rank_module(tmp_path):
    fixtures = tmp_path / "fixtures"
    for rel, text in {
        "__init__.py": "",
        "helpers.py": "",
        "runner/__init__.py": '"""The runner."""',
        "silent/__init__.py": "",
        "ranks/__init__.py": '"""Ranks."""',
        "ranks/shared_rank_fns.py": "",
    }.items():
        (fixtures / rel).parent.mkdir(parents=True, exist_ok=True)
        (fixtures / rel).write_text(text)
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "test_export.py").write_text("from fixtures.ranks import shared_rank_fns\n")
    assert loose_entries(fixtures) == ["helpers.py"]
    assert undocumented_packages(fixtures) == ["silent"]
    assert misnamed_rank_modules(tmp_path) == [
        "shared_rank_fns.py: only test_export.py uses it; name it for that suite"
    ]
