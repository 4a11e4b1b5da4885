"""The conformance suites judge any implementation, so they reach none directly: no conformance test, program or
judge imports an implementation (``impl``, ``implementations``) or takes the reference's ``impl`` fixture, and the
judge imports only the oracle's side (torch, transformers, PEFT, safetensors, ``tiny_models``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fixtures.conformance.plugin import CAPABILITIES
from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

IMPLEMENTATIONS = ("impl", "implementations")
JUDGE_MAY_IMPORT = ("torch", "transformers", "peft", "safetensors", "tiny_models", "dsv4_conformance", "json", "re")


def _conformance_files(root: Path = REPO_ROOT) -> list[Path]:
    files = [p for name in CAPABILITIES for p in sorted((root / "suites" / name).rglob("*.py"))]
    return (
        files
        + sorted((root / "fixtures" / "conformance").rglob("*.py"))
        + sorted((root / "dsv4_conformance").rglob("*.py"))
    )


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(files: list[Path], root: Path) -> list[str]:
    bad = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root).as_posix()
        bad += [f"{rel}:{line}: imports {m}" for line, m in _imported(tree) if m.split(".")[0] in IMPLEMENTATIONS]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "impl" for a in node.args.args):
                bad.append(f"{rel}:{node.lineno}: {node.name} takes the reference's impl fixture")
    return bad


def test_no_conformance_test_program_or_judge_reaches_an_implementation():
    bad = _violations(_conformance_files(), REPO_ROOT)
    assert not bad, "the conformance side reaches an implementation directly:\n  " + "\n  ".join(bad)


def test_the_judge_imports_only_the_oracles_side():
    stdlib = {"__future__", "collections", "dataclasses", "enum", "functools", "pathlib", "typing", "math", "importlib"}
    bad = [
        f"{p.relative_to(REPO_ROOT)}:{line}: imports {m}"
        for p in sorted((REPO_ROOT / "dsv4_conformance").rglob("*.py"))
        for line, m in _imported(ast.parse(p.read_text()))
        if m.split(".")[0] not in (*JUDGE_MAY_IMPORT, *stdlib)
    ]
    assert not bad, "the judge must depend on the oracle's side alone:\n  " + "\n  ".join(bad)


def test_the_check_sees_an_implementation_import_and_the_impl_fixture(tmp_path):
    impl, implementations = IMPLEMENTATIONS  # spelled out, the boundary check would take this example for an import
    reaching = [f"import {impl}", f"from {implementations}.reference import DRIVER", "def test_x(impl):", "    pass"]
    (tmp_path / "t.py").write_text("\n".join(reaching) + "\n")
    bad = _violations([tmp_path / "t.py"], tmp_path)
    assert len(bad) == 3, bad


def test_the_command_lines_room_reaches_an_implementation_only_through_its_driver():
    """``dsv4_lora`` (``qualify --driver``) loads the driver a user names and imports no implementation itself."""
    files = sorted((REPO_ROOT / "dsv4_lora").rglob("*.py"))
    assert files, "dsv4_lora/ holds no module"
    bad = _violations(files, REPO_ROOT)
    assert not bad, "the command line's room reaches an implementation directly:\n  " + "\n  ".join(bad)
