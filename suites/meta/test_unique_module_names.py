"""No two modules of the project share a file name (a reader who sees ``checkpoint.py`` in a traceback knows which
one it is), except each package's ``__init__.py`` and each top-level package's own ``errors.py``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

PACKAGES = ("impl", "implementations", "fixtures", "tiny_models", "suites", "scripts")
#: names every package may have once: its marker, and the errors module of a top-level package
SHARED_NAMES = frozenset({"__init__.py", "errors.py", "conftest.py"})


def clashes(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = defaultdict(list)
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            seen[path.name].append(path.relative_to(root).as_posix())
    return {name: where for name, where in sorted(seen.items()) if len(where) > 1 and name not in SHARED_NAMES}


def test_no_two_modules_share_a_file_name():
    found = clashes(REPO_ROOT)
    assert not found, "modules with the same file name (rename one for what it is):\n  " + "\n  ".join(
        f"{name}: {', '.join(where)}" for name, where in found.items()
    )


def test_a_clash_is_named(tmp_path):
    for rel in ("impl/conversion/checkpoint.py", "impl/lora/checkpoint.py", "fixtures/errors.py", "impl/errors.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert clashes(tmp_path, ("impl", "fixtures")) == {
        "checkpoint.py": ["impl/conversion/checkpoint.py", "impl/lora/checkpoint.py"]
    }
