"""The boundary between the suite and the implementation holds, and a broken implementation is noticed.

The rule, checked on the source of ``suites/`` and ``fixtures/`` (``conftest.py`` included):

1. No direct import of the implementation package: ``import impl``, ``import impl.x``, ``from impl... import``,
   ``importlib.import_module("impl...")``, nor such an import inside a string of Python code that a test runs in a
   subprocess. The suites reach the implementation only through the ``impl`` fixture, or, in a rank function or a
   subprocess, through ``fixtures.runner.impl_loader`` with the implementation's name, so ``--impl other`` tests ``other``
   everywhere.
2. No private attribute of an implementation object: a name starting with ``_`` (dunders such as ``__name__`` are
   fine) reached from a value that comes from the implementation. Such values are found per function by following
   assignments: a parameter or variable named ``impl``, a name imported from ``impl``, the result of ``load_impl``,
   a fixture whose return value is one of those, and any name assigned from an expression that uses one of them.
   ``getattr(x, "_name")`` and ``monkeypatch.setattr(x, "_name", ...)`` / ``monkeypatch.setattr("impl.x._name", ...)``
   count as well. Private names are the implementation's to change; a suite that reads them tests one
   implementation, not the contract.

Values merely computed with an implementation object (``torch.tensor(impl.x)``) count as implementation values too:
the rule errs on the side of reporting, and a reported line is fixed by going through public API.

No exemption: the rank launcher the runner and the command line share is a package of its own (``dsv4_launcher/``)
that imports nothing of the implementation, so the harness imports it like any other library.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.runner.impl_copy import MutationError, TextMutation, copy_implementation, rename_package
from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

IMPL_PACKAGE = "impl"
SCANNED = ("suites", "fixtures", "conftest.py")

_MODULE_PATH = re.compile(rf"{IMPL_PACKAGE}(?:\.\w+)+")  # a dotted path into the package: imported or patched
_CODE_IMPORT = re.compile(rf"^\s*(?:import\s+{IMPL_PACKAGE}\b|from\s+{IMPL_PACKAGE}(?:\.\w+)*\s+import\b)", re.M)


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str  # "import" or "private"
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.what}"


def _is_impl_module(name: object) -> bool:
    return isinstance(name, str) and (name == IMPL_PACKAGE or name.startswith(IMPL_PACKAGE + "."))


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _import_violations(tree: ast.AST, path: str) -> Iterator[Violation]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_impl_module(alias.name):
                    yield Violation(path, node.lineno, "import", f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_impl_module(node.module):
            yield Violation(path, node.lineno, "import", f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and _call_name(node) != "load_impl" and _loads_impl(node):
            yield Violation(path, node.lineno, "import", f"{_call_name(node)}({node.args[0].value!r})")
        elif isinstance(node, ast.Call) and _call_name(node) == "load_impl" and node.args:
            if isinstance(node.args[0], ast.Constant):
                yield Violation(path, node.lineno, "import", f"load_impl({node.args[0].value!r}) ignores --impl")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _CODE_IMPORT.search(node.value):
                found = _CODE_IMPORT.search(node.value).group(0).strip()
                yield Violation(path, node.lineno, "import", f"{found!r} in code run as a string")
            elif _MODULE_PATH.fullmatch(node.value):
                yield Violation(path, node.lineno, "import", f"names the module {node.value!r}")


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _loads_impl(call: ast.Call) -> bool:
    """``load_impl(...)``, or ``import_module("impl...")`` / ``__import__("impl...")``."""
    name = _call_name(call)
    if name == "load_impl":
        return True
    first = call.args[0] if call.args else None
    return name in {"import_module", "__import__"} and isinstance(first, ast.Constant) and _is_impl_module(first.value)


def _names_in(node: ast.AST | None) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _root(node: ast.AST) -> ast.AST:
    """``a`` of ``a.b[c].d(e).f``: the value an attribute chain starts from."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


class _Taint(ast.NodeVisitor):
    """Collects private-attribute uses on implementation values in one scope (nested scopes inherit it)."""

    def __init__(self, path: str, tainted: set[str], fixtures: set[str]):
        self.path, self.tainted, self.fixtures = path, set(tainted), fixtures
        self.found: list[Violation] = []
        self.returns_impl = False

    def _uses_impl(self, node: ast.AST | None) -> bool:
        if node is None:
            return False
        return bool(_names_in(node) & self.tainted) or any(
            isinstance(n, ast.Call) and _loads_impl(n) for n in ast.walk(node)
        )

    def _bind(self, targets: ast.AST, value: ast.AST | None) -> None:
        if self._uses_impl(value):
            self.tainted |= _targets(targets)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self._bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        self._bind(node.target, node.value)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.generic_visit(node)
        self._bind(node.target, node.value)

    def visit_For(self, node: ast.For) -> None:
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._bind(node.optional_vars, node.context_expr)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and _is_impl_module(node.module):
            self.tainted |= {alias.asname or alias.name for alias in node.names}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_impl_module(alias.name):
                self.tainted.add(alias.asname or alias.name.split(".")[0])

    def visit_Return(self, node: ast.Return) -> None:
        self.generic_visit(node)
        self.returns_impl |= self._uses_impl(node.value)

    def visit_Yield(self, node: ast.Yield) -> None:
        self.generic_visit(node)
        self.returns_impl |= self._uses_impl(node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root = _root(node.value)
        if _is_private(node.attr) and isinstance(root, ast.Name) and root.id in self.tainted:
            self.found.append(Violation(self.path, node.lineno, "private", f"{ast.unparse(node)}"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        name, args = _call_name(node), node.args
        if name in {"getattr", "setattr", "delattr", "hasattr"} and len(args) >= 2 and self._uses_impl(args[0]):
            if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) and _is_private(args[1].value):
                self.found.append(Violation(self.path, node.lineno, "private", ast.unparse(node)[:120]))
        if name in {"setattr", "delattr", "setitem"} and args and isinstance(args[0], ast.Constant):
            target = args[0].value
            if isinstance(target, str) and _is_impl_module(target) and any(map(_is_private, target.split("."))):
                self.found.append(Violation(self.path, node.lineno, "private", f"patches {target!r}"))

    def _scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        inner = _Taint(self.path, (self.tainted - params) | (params & ({IMPL_PACKAGE} | self.fixtures)), self.fixtures)
        for stmt in node.body if isinstance(node.body, list) else [node.body]:
            inner.visit(stmt)
        if isinstance(node, ast.Lambda):
            inner.returns_impl |= inner._uses_impl(node.body)
        self.found += inner.found
        if inner.returns_impl and _is_fixture(node):
            self.fixtures.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope


def _is_fixture(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any("fixture" in ast.unparse(d) for d in decorators)


def private_access_violations(tree: ast.Module, path: str) -> list[Violation]:
    """Private attributes reached from implementation values (see the module docstring); two passes, so a fixture
    defined below its users still counts as an implementation value."""
    fixtures: set[str] = set()
    for _ in range(2):
        scan = _Taint(path, set(), fixtures)
        scan.visit(tree)
    return scan.found


def scan_source(source: str, path: str) -> list[Violation]:
    tree = ast.parse(source, filename=path)
    return sorted({*_import_violations(tree, path), *private_access_violations(tree, path)}, key=str)


def _scanned_files(root: Path) -> Iterator[Path]:
    """Every Python file of SCANNED, except this one (its examples of violations are strings of code)."""
    for entry in SCANNED:
        target = root / entry
        for file in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            if file.resolve() != Path(__file__).resolve():
                yield file


def scan_tree(root: Path) -> list[Violation]:
    found: list[Violation] = []
    for file in _scanned_files(root):
        found += scan_source(file.read_text(), file.relative_to(root).as_posix())
    return found


def test_the_launcher_imports_nothing_of_the_implementation():
    found = [
        f"{p.relative_to(REPO_ROOT)}: {line.strip()}"
        for p in sorted((REPO_ROOT / "dsv4_launcher").glob("*.py"))
        for line in p.read_text().splitlines()
        if _CODE_IMPORT.match(line)
    ]
    assert not found, (
        "the launcher imports the implementation (it must stay a library both sides use):\n  " + "\n  ".join(found)
    )


def test_suites_and_fixtures_reach_the_implementation_only_through_its_public_api():
    found = scan_tree(REPO_ROOT)
    assert not found, "the suite reaches past the impl fixture:\n  " + "\n  ".join(map(str, found))


VIOLATIONS = {
    "import": ("import impl\n", "import impl"),
    "import-submodule": ("import impl.adapter.export as ex\n", "import impl.adapter.export"),
    "from-import": ("from impl.adapter.export import PHASES\n", "from impl.adapter.export import ..."),
    "import-module": ("import importlib\nm = importlib.import_module('impl.cli')\n", "import_module('impl.cli')"),
    "code-string": ("CODE = '''\nimport impl.compat.active\n'''\n", "'import impl' in code run as a string"),
    "private-on-fixture": ("def test_x(impl):\n    impl._PUBLIC\n", "impl._PUBLIC"),
    "private-on-derived": (
        "def test_x(impl):\n    bridge = impl.DeepseekV4ConversionBridge()\n    return bridge._registry\n",
        "bridge._registry",
    ),
    "private-on-fixture-value": (
        "import pytest\n@pytest.fixture\ndef native(impl):\n    return impl.native\n"
        "def test_x(native):\n    native.model._head(1)\n",
        "native.model._head",
    ),
    "getattr-private": ("def test_x(impl):\n    getattr(impl.PHASES, '_fns')\n", "getattr(impl.PHASES, '_fns')"),
    "patch-private-path": (
        "def test_x(monkeypatch):\n    monkeypatch.setattr('impl.adapter.export._PHASE_FNS', {})\n",
        "patches 'impl.adapter.export._PHASE_FNS'",
    ),
    "private-on-imported-module": (
        "import importlib\nexport = importlib.import_module('impl.adapter.export')\nexport._PHASE_FNS\n",
        "export._PHASE_FNS",
    ),
    "hard-coded-name": ("def rank():\n    load_impl('impl')\n", "load_impl('impl') ignores --impl"),
    "module-path": ("CLI = ['python', '-m', 'impl.cli']\n", "names the module 'impl.cli'"),
    "private-on-loaded": (
        "from fixtures.runner.impl_loader import load_impl\ndef rank(name):\n    mod = load_impl(name).module\n"
        "    return mod._WHERE\n",
        "mod._WHERE",
    ),
}


@pytest.mark.parametrize(("source", "what"), VIOLATIONS.values(), ids=list(VIOLATIONS))
def test_the_boundary_scan_reports_a_violation_with_its_line(source, what):
    found = scan_source(source, "suites/reference/test_example.py")
    assert [str(v) for v in found if what in str(v)], f"{what!r} not reported; found {[str(v) for v in found]}"
    assert all(v.path == "suites/reference/test_example.py" and v.line >= 1 for v in found)


ALLOWED = {
    "dunder": "def test_x(impl):\n    impl.DeepseekV4NativeModel.__name__\n",
    "private-on-a-non-impl-object": "import os\ndef test_x(impl):\n    os._exit\n    dispatcher = object()\n"
    "    dispatcher._name\n",
    "a rebound parameter": "def helper(impl):\n    pass\ndef test_x(model):\n    model._modules\n",
    "the loader with the implementation's name": "from fixtures.runner.impl_loader import load_impl\n"
    "def rank(impl_name):\n    load_impl(impl_name).DIALECTS\n",
    "a prose mention": "DOC = 'suites never import impl directly'\n",
}


@pytest.mark.parametrize("source", ALLOWED.values(), ids=list(ALLOWED))
def test_the_boundary_scan_allows_public_api_and_other_objects(source):
    assert scan_source(source, "suites/reference/test_example.py") == []


# --- a deliberately broken copy of the implementation, run under --impl, must make the suite fail ---------------


def _drop_target_qualification(package_dir: Path) -> None:
    """Mutant: ``qualify_targets`` hands names back unqualified, so a bare ``wkv`` also wraps both compressors
    (overridden at the end of its module, so the mutant survives edits to the function itself)."""
    with open(package_dir / "lora" / "targets.py", "a") as fh:
        fh.write("\n\ndef qualify_targets(targets, *args, **kwargs):  # mutant\n    return targets\n")


#: The control's selection: killing tests of the mutation check's catalogue (fixtures/mutations/catalogue/), one per
#: kind of run (a plain test, a module fixture, two ranks, the export fault matrix, the recipe's rank function). The
#: unbroken copy passing them shows renaming the package breaks none of them, which is what lets the mutation check
#: take its control from CI's main run (scripts/mutation_check.py --earlier-run).
CONTROL_SELECTION = (
    "suites/reference/test_export_format.py::test_grouped_o_a_proj_runs_unmerged_through_the_grouped_peft_layer",
    "suites/reference/test_target_qualifier.py::test_bare_wkv_never_matches_a_compressor",
    "suites/reference/test_provider.py::test_ddp_is_built_after_the_pre_wrap_hook",
    "suites/reference/test_recipe.py::test_gpu32_rank_function_trains_and_exports_the_tiny_variant_on_two_cpu_ranks",
    "suites/reference/test_export_collective.py::"
    "test_failure_in_any_phase_on_any_rank_raises_the_same_error_everywhere_and_publishes_nothing[ws2-rank1-write]",
)
#: (mutation, tests that must fail against it), each run in a pytest subprocess with --impl <the mutant's name>: one
#: broken copy shows the README's test command that --impl reaches the copy; the catalogue's rows (the same kind of
#: breakage, each with its killing test) are the mutation check's, which CI runs.
MUTANTS = {
    "targets-left-unqualified": pytest.param(
        _drop_target_qualification,
        ("suites/reference/test_target_qualifier.py::test_bare_wkv_never_matches_a_compressor",),
        id="targets-left-unqualified",
    ),
}


def _run_selection(copy, node_ids: tuple[str, ...]):
    """Run ``node_ids`` (from the repository root, so conftest and fixtures load as usual) against ``copy``."""
    from fixtures.runner.subproc import pytest_outcomes
    from fixtures.runner.warm_pytest import pytest_on_copy

    args = ["-m", "cpu", "-n", "0", "-rA", "--impl", copy.name, *node_ids]
    rc, out = pytest_on_copy(args, copy_dir=copy.path, copy_name=copy.name, timeout=600)
    assert rc is not None, f"the run against {copy.name} timed out:\n{out[-3000:]}"
    assert f"dsv4: impl={copy.name} " in out, f"the run did not test {copy.name}:\n{out[-3000:]}"
    return rc, pytest_outcomes(out), out


@pytest.mark.slow
def test_an_unbroken_copy_of_the_implementation_passes_the_selection(tmp_path):
    """The control: renaming the package breaks nothing, so the failures below come from the mutations."""
    rc, outcomes, out = _run_selection(copy_implementation(tmp_path), CONTROL_SELECTION)
    assert rc == 0 and outcomes and set(outcomes.values()) == {"PASSED"}, f"exit {rc}: {outcomes}\n{out[-4000:]}"
    for node in CONTROL_SELECTION:
        assert any(n.startswith(node) for n in outcomes), f"{node} did not run:\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize(("mutation", "node_ids"), MUTANTS.values())
def test_broken_implementation_is_noticed(tmp_path, mutation, node_ids):
    rc, outcomes, out = _run_selection(copy_implementation(tmp_path, mutation=mutation), node_ids)
    for node in node_ids:
        hits = {n: word for n, word in outcomes.items() if n.startswith(node)}
        # ERROR counts too: a module fixture may be what a mutant breaks; the control shows the unbroken copy passes.
        noticed = {"FAILED", "ERROR"} & set(hits.values())
        assert noticed, f"{node} did not fail against the mutant: {hits}\n{out[-3000:]}"
    assert rc == 1, f"exit {rc} (1 = tests failed; anything else is a broken run)\n{out[-3000:]}"


def test_the_copy_renames_module_references_and_nothing_else():
    source = (
        "import impl\n"
        "import impl.compat.active  # impl.compat in a comment stays\n"
        "from impl.errors import Dsv4Error\n"
        "TABLE = {'impl.adapter.gather': ('x',), \"impl\": 1}\n"
        "value = impl.compat_report(); holder.impl = impl\n"
        "TEXT = 'the impl fixture'\n"
        "def f(x):\n    return f'{x} impl.native.model'\n"
    )
    assert rename_package(source, "impl", "impl_mutant") == (
        "import impl_mutant\n"
        "import impl_mutant.compat.active  # impl.compat in a comment stays\n"
        "from impl_mutant.errors import Dsv4Error\n"
        "TABLE = {'impl_mutant.adapter.gather': ('x',), \"impl_mutant\": 1}\n"
        "value = impl_mutant.compat_report(); holder.impl = impl_mutant\n"
        "TEXT = 'the impl fixture'\n"
        "def f(x):\n    return f'{x} impl_mutant.native.model'\n"
    )


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        (TextMutation("errors.py", "no such text in the file", "x"), "occurs 0 times"),
        (TextMutation("errors.py", "class ", "class  "), r"occurs \d+ times, expected exactly once"),
        (TextMutation("no/such/file.py", "x", "y"), "does not exist"),
    ],
    ids=["absent", "ambiguous", "no-file"],
)
def test_a_text_mutation_that_does_not_apply_exactly_once_is_an_error(tmp_path, mutation, message):
    with pytest.raises(MutationError, match=message):
        copy_implementation(tmp_path, mutation=mutation)


def test_a_mutation_reaches_only_the_copy(tmp_path):
    copy = copy_implementation(tmp_path, mutation=TextMutation("errors.py", "class Dsv4Error(", "class Dsv4Mutant("))
    assert "class Dsv4Mutant(" in (copy.package_dir / "errors.py").read_text()
    assert "class Dsv4Error(" in (REPO_ROOT / "impl" / "errors.py").read_text()


def test_the_copy_carries_every_module_and_data_file_and_no_cache(tmp_path):
    """A mutant must read the same tables and texts (``*.toml``) as the implementation, or every test of a
    command would fail on the copy for a reason no mutation made."""

    def files(root):
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}

    copy = copy_implementation(tmp_path)
    source = files(REPO_ROOT / "impl")
    assert any(p.suffix == ".toml" for p in source), "impl/ has no data file: this test proves nothing"
    assert files(copy.package_dir) == {p for p in source if p.suffix not in (".pyc", ".pyo")}
