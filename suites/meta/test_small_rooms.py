"""House rule, enforced: every module under 600 lines, every function under 80 (decorators included).

Scans the project's own Python files (``impl``, ``fixtures``, ``suites``, ``tiny_models``, ``scripts``,
``conftest.py``); a failure names each file (and function) with its size, so a reader finds the room to split.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
SCANNED = ("impl", "fixtures", "suites", "tiny_models", "scripts", "conftest.py")


def _files(root: Path) -> list[Path]:
    out: list[Path] = []
    for entry in SCANNED:
        path = root / entry
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def oversized(source: str, name: str) -> list[str]:
    """Every way ``source`` breaks the size rule, as ``name[:function]: N lines``."""
    problems = []
    lines = source.count("\n") + (not source.endswith("\n") and bool(source))
    if lines >= MAX_MODULE_LINES:
        problems.append(f"{name}: {lines} lines (module limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            length = node.end_lineno - start + 1
            if length >= MAX_FUNCTION_LINES:
                problems.append(f"{name}:{start} {node.name}: {length} lines (function limit {MAX_FUNCTION_LINES})")
    return problems


def test_every_module_and_function_is_small():
    problems = [p for f in _files(REPO_ROOT) for p in oversized(f.read_text(), f.relative_to(REPO_ROOT).as_posix())]
    assert not problems, "split these:\n  " + "\n  ".join(problems)


def test_the_size_check_reports_a_long_function_and_a_long_module():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    long_function = f"@decorator\ndef big():\n{body}"
    assert oversized(long_function, "m.py") == [f"m.py:1 big: {MAX_FUNCTION_LINES + 2} lines (function limit 80)"]
    long_module = "x = 1\n" * MAX_MODULE_LINES
    assert oversized(long_module, "m.py") == [f"m.py: {MAX_MODULE_LINES} lines (module limit 600)"]
    assert oversized("def small():\n    return 1\n", "m.py") == []


MAX_MODULE_DOCSTRING_LINES = 6


def docstring_lines(source: str) -> int:
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return doc.count("\n") + 1 if doc else 0


def test_every_module_docstring_of_the_implementation_says_what_and_why_in_a_few_lines():
    files = sorted((REPO_ROOT / "impl").rglob("*.py"))
    sizes = {p.relative_to(REPO_ROOT).as_posix(): docstring_lines(p.read_text()) for p in files}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_DOCSTRING_LINES}
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move detail to the function): {long}"
