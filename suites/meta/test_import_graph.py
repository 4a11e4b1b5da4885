"""The implementation's modules import one another without a circle and downwards, counting every import (a
function's lazy one too): a reader can follow any name down to where it is defined, no module needs another
half-initialised, and an import that runs up a floor says why where it happens (``# up a floor: <why>``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "impl"

#: The floors of ``impl``, lowest first (rooms relative to the package): a module imports from its own floor or
#: below. The names everything shares sit at the bottom; the base graph knows no adapter; what assembles the graph,
#: the adapters and Bridge (the conversion bridge) sits above them; what a user runs sits on top.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "data_tables", "vocabulary", "compat"),
    ("conversion",),
    ("native",),
    ("lora",),
    ("adapter",),
    ("bridge",),
    ("recipe",),
    ("driver", "cli"),
)
UP_REASON = "# up a floor:"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_nodes(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node, [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports anywhere in its body (``from a import b`` counts ``a.b`` when that
    is a module). The facade (``import impl``) is left out: it imports nothing at its own import."""
    found = {name for _, names in _import_nodes(path) for name in names}
    return {m for m in found if m in modules and m != PACKAGE}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_implementation_imports_itself_round_a_circle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert sum(map(len, graph.values())) > len(modules), "the import graph is implausibly sparse"
    circles = _cycles(graph)
    assert not circles, "modules that import one another round a circle: " + "; ".join(" -> ".join(c) for c in circles)


def floor(module: str) -> int:
    """The floor of ``module`` (its room's)."""
    for level, rooms in enumerate(FLOORS):
        if any(module == f"{PACKAGE}.{room}" or module.startswith(f"{PACKAGE}.{room}.") for room in rooms):
            return level
    raise KeyError(module)


def imports_up(path: Path, module: str, modules: dict[str, Path]) -> list[str]:
    """``path``'s imports of a module on a higher floor that do not say why on their line or the line above."""
    lines = path.read_text().splitlines()
    found = []
    for node, names in _import_nodes(path):
        said = any(UP_REASON in lines[n - 1] for n in (node.lineno - 1, node.lineno) if n >= 1)
        for name in names:
            if name in modules and name != PACKAGE and floor(name) > floor(module) and not said:
                found.append(f"{module} (line {node.lineno}) -> {name}")
    return found


def test_every_module_of_the_implementation_has_a_floor():
    rooms = {name for name in _modules() if name != PACKAGE}
    missing = []
    for name in sorted(rooms):
        try:
            floor(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"modules on no floor (add their room to FLOORS): {missing}"


def test_an_import_up_a_floor_is_found_unless_it_says_why(tmp_path):
    low, high = f"{PACKAGE}.conversion.a", f"{PACKAGE}.adapter.b"
    modules = {low: tmp_path / "a.py", high: tmp_path / "b.py"}
    modules[low].write_text(f"from {high} import x\n")
    assert imports_up(modules[low], low, modules) == [f"{low} (line 1) -> {high}"]
    modules[low].write_text(f"{UP_REASON} the reason\nfrom {high} import x\n")
    assert imports_up(modules[low], low, modules) == []


def test_no_module_imports_up_a_floor_without_saying_why():
    modules = _modules()
    found = [line for name, path in modules.items() if name != PACKAGE for line in imports_up(path, name, modules)]
    assert not found, f"imports that run up a floor (move the name down, or say why with {UP_REASON!r}):\n  " + (
        "\n  ".join(found)
    )


def design_floors(text: str) -> list[tuple[str, ...]]:
    """The rooms of each floor as ``docs/DESIGN.md``'s floor table lists them (`room/` or `module.py`)."""
    rows = [
        line.split("|") for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    out = []
    for cells in rows:
        names = [n.strip().strip("`") for n in cells[2].split(",")]
        out.append(tuple(n.removesuffix("/").removesuffix(".py") for n in names))
    return out


def test_the_design_map_shows_the_floors_the_imports_keep():
    documented = design_floors((ROOT / "docs" / "DESIGN.md").read_text())
    assert documented == [tuple(rooms) for rooms in FLOORS], (
        "docs/DESIGN.md's floor table and FLOORS disagree (rooms per floor, lowest first):\n"
        f"  DESIGN.md: {documented}\n  FLOORS:    {list(FLOORS)}"
    )
