"""The implementation never reads the oracle: no module of the implementation imports ``tiny_models``, ``fixtures`` or
the conformance judge (``dsv4_conformance``).

A name table, shape rule or expected value shared by the implementation and the suite's oracle hides every bug in
it. Allowed, by exact module and imported name: the command line writes its embedded default base and the
Flash/Pro manifests with ``tiny_models``; ``qualify`` and ``verify-adapter`` compare through the judge's oracle, by
its rules (one home for both: ``dsv4_conformance.judge.oracle``), and ``verify-adapter`` reports the judge's verdict;
the exporter fails closed by the judge's consumer rules (facts about the engines, checked against their code).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv4_conformance.judge import consumers as judge_consumers

pytestmark = pytest.mark.cpu

ORACLE_PACKAGES = ("tiny_models", "fixtures", "dsv4_conformance")
#: (module file relative to the implementation package, imported module, imported name)
ALLOWED = {
    ("cli/main.py", "tiny_models.manifest", "manifest"),
    ("cli/main.py", "tiny_models.presets", "PRESETS"),  # --preset / --manifest names checked before anything runs
    ("cli/main.py", "tiny_models.presets", "flash_config"),
    ("cli/main.py", "tiny_models.presets", "get_preset"),
    ("cli/main.py", "tiny_models.presets", "pro_config"),
    # qualify has the judge read a given base before any rank starts
    *(("cli/main.py", "dsv4_conformance.judge.base", n) for n in ("base_layout", "base_problems")),
    # the driver speaks the contract's types (qualify judges through it: dsv4_lora.qualify_driver)
    *(("driver.py", "dsv4_conformance.driver", n) for n in ("Driver", "Layout", "LoadReport", "LoraSpec")),
    # the engines' rules (facts about the engines, checked against their own code): the exporter fails closed by them
    *(("adapter/consumers.py", "dsv4_conformance.judge.consumers", name) for name in judge_consumers.__all__),
    # verify-adapter reports the conformance judge's verdict and reloads through the judge's oracle
    ("cli/verify.py", "dsv4_conformance.judge.artifacts", "judge_adapter_dir"),
    *(
        ("cli/verify.py", "dsv4_conformance.judge.oracle", name)
        for name in ("LOGIT_RULE", "base_model", "delta_logits", "max_abs", "peft_logits", "read_adapter")
    ),
}
_DYNAMIC = {"import_module", "__import__"}


def _imports(tree: ast.AST) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, imported name or None for the whole module) of every absolute import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0] if node.args else None
            if called in _DYNAMIC and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value, None


def oracle_imports(package: Path) -> list[str]:
    """``file:line: ...`` for every import of an oracle package under ``package`` that is not allow-listed."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for line, module, name in sorted(
            _imports(ast.parse(path.read_text(), filename=str(path))), key=lambda hit: hit[0]
        ):
            if module.split(".")[0] not in ORACLE_PACKAGES or (rel, module, name) in ALLOWED:
                continue
            what = f"import {module}" if name is None else f"from {module} import {name}"
            found.append(f"{package.name}/{rel}:{line}: {what}")
    return found


def test_the_implementation_imports_no_oracle_outside_the_allow_list(impl):
    package = Path(impl.module.__file__).parent
    found = oracle_imports(package)
    assert not found, "the implementation reads the oracle:\n  " + "\n  ".join(found)


def test_every_forbidden_import_form_is_named_with_file_and_line(tmp_path):
    package = tmp_path / "impl"
    (package / "cli").mkdir(parents=True)
    (package / "cli" / "main.py").write_text(
        "from tiny_models.presets import get_preset\n"  # allowed here
        "from tiny_models.oracle import load_oracle\n"  # allowed only in qualify
    )
    (package / "cli" / "verify.py").write_text(
        "import json\n"
        "def f():\n"
        "    from tiny_models.oracle import official_to_transformers_name\n"
        "    import tiny_models.presets\n"
        "    from fixtures import asserts\n"
        "    import importlib\n"
        "    return importlib.import_module('tiny_models.presets')\n"
    )
    (package / "recipe.py").write_text("from tiny_models.oracle import load_oracle\n")
    assert oracle_imports(package) == [
        "impl/cli/main.py:2: from tiny_models.oracle import load_oracle",
        "impl/cli/verify.py:3: from tiny_models.oracle import official_to_transformers_name",
        "impl/cli/verify.py:4: import tiny_models.presets",
        "impl/cli/verify.py:5: from fixtures import asserts",
        "impl/cli/verify.py:7: import tiny_models.presets",
        "impl/recipe.py:1: from tiny_models.oracle import load_oracle",
    ]
