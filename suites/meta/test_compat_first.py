"""Nothing imports megatron ahead of the CPU compatibility layer: every module of the implementation that imports
megatron first imports ``impl.compat.active``: at its top, or, for an import inside a function, earlier in that
function (for a module whose other half must stay light, as the launcher's side of ``qualify``). So the package
needs no list of which modules want megatron: importing one is what installs the layer (``impl/__init__.py``
imports lazily and nothing more)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

COMPAT_ACTIVE = "compat.active"


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested directly in ``stmt`` (bodies of functions, classes, branches, handlers)."""
    out = []
    for field in ("body", "orelse", "finalbody"):
        inner = getattr(stmt, field, None)
        if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
            out.append(inner)
    out += [h.body for h in getattr(stmt, "handlers", [])]
    return out


def _unguarded(body: list[ast.stmt], package: str, guarded: bool) -> list[int]:
    """Lines of megatron imports in ``body`` (and what nests in it) with no compat import before them in scope."""
    found = []
    for stmt in body:
        names = _imported(stmt)
        if f"{package}.{COMPAT_ACTIVE}" in names:
            guarded = True
        elif any(n.split(".")[0] == "megatron" for n in names) and not guarded:
            found.append(stmt.lineno)
        for block in _blocks(stmt):
            found += _unguarded(block, package, guarded)
    return found


def compat_violations(package: Path) -> list[str]:
    """``file:line: ...`` for every megatron import with no compat import before it in its module or function."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("compat/"):
            continue  # the layer itself: it imports megatron in the order it needs
        tree = ast.parse(path.read_text(), filename=str(path))
        for line in sorted(_unguarded(tree.body, package.name, False)):
            found.append(f"{package.name}/{rel}:{line}: imports megatron without {package.name}.{COMPAT_ACTIVE} first")
    return found


def test_every_module_that_imports_megatron_installs_the_compat_layer_first(impl):
    found = compat_violations(Path(impl.module.__file__).parent)
    assert not found, "megatron could be imported ahead of the CPU compat layer:\n  " + "\n  ".join(found)


def test_a_megatron_import_without_the_compat_layer_first_is_named(tmp_path):
    package = tmp_path / "other"  # another implementation: its own package name
    (package / "compat").mkdir(parents=True)
    files = {
        "compat/__init__.py": "import megatron.core\n",  # the layer itself: exempt
        "good.py": "import other.compat.active\nfrom megatron.core import parallel_state\n",
        "local.py": "def f():\n    import other.compat.active\n    import megatron.core\n",
        "late.py": "def f():\n    import megatron.core\n",
        "after.py": "from megatron.core import x\nimport other.compat.active\n",
        "sibling.py": "def f():\n    import other.compat.active\n\ndef g():\n    if True:\n        import megatron.core\n",
    }
    for rel, text in files.items():
        (package / rel).write_text(text)
    assert compat_violations(package) == [
        "other/after.py:1: imports megatron without other.compat.active first",
        "other/late.py:2: imports megatron without other.compat.active first",
        "other/sibling.py:6: imports megatron without other.compat.active first",
    ]
