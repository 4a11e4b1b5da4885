"""Every error class of the implementation is defined in its ``errors`` module: a reader finds every way the package
can fail in one file, and an error type is never defined twice. The module that raises an error re-exports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ERRORS_MODULE = "errors.py"


def _is_error_class(node: ast.ClassDef) -> bool:
    named = [node.name, *(ast.unparse(b).split(".")[-1] for b in node.bases)]
    return any(n.endswith(("Error", "Exception")) for n in named)


def errors_elsewhere(package: Path) -> list[str]:
    """``file:line: class Name`` for every error class defined outside ``package/errors.py``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == ERRORS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and _is_error_class(node):
                found.append(f"{package.name}/{rel}:{node.lineno}: class {node.name}")
    return found


def test_every_error_class_is_defined_in_the_errors_module(impl):
    found = errors_elsewhere(Path(impl.module.__file__).parent)
    assert not found, f"error classes outside {ERRORS_MODULE} (move them there):\n  " + "\n  ".join(found)


def test_an_error_class_defined_elsewhere_is_named(tmp_path):
    package = tmp_path / "other"
    (package / "adapter").mkdir(parents=True)
    (package / ERRORS_MODULE).write_text("class Dsv4Error(Exception):\n    pass\n")
    (package / "adapter" / "build.py").write_text(
        "from other.errors import Dsv4Error\n\nclass Helper:\n    pass\n\nclass EmptyAdapter(Dsv4Error):\n    pass\n"
    )
    (package / "adapter" / "io.py").write_text("class ReadError(OSError):\n    pass\n")
    assert errors_elsewhere(package) == [
        "other/adapter/build.py:6: class EmptyAdapter",
        "other/adapter/io.py:1: class ReadError",
    ]
