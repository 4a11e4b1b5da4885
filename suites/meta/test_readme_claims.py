"""The README's figures and versions stay true: each figure it states is a row of docs/performance.md's table of
what measured it, the ``.venv`` this suite runs in is the size it says, and each engine version it names is the one
the project installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

#: a figure: "about 2 minutes and 5 GB", "about 15 seconds", "under ten minutes"
FIGURE = re.compile(r"\b(?:about|under) (?:\d+|\w+) (?:seconds|minutes)(?: and \d+ GB)?")
#: an engine the README names with the versions the project installs for it: one lane per release, each
#: requirements/consumers-<dist>*.txt pinning one (vLLM: consumers-vllm.txt, consumers-vllm-0.34.txt)
ENGINES = {"vLLM": "vllm", "SGLang": "sglang"}


def _readme() -> str:
    return (REPO_ROOT / "README.md").read_text().replace("\n", " ")


def _figures_table() -> str:
    text = (REPO_ROOT / "docs" / "performance.md").read_text()
    assert "## The README's figures" in text, "docs/performance.md lost its table of the README's figures"
    return text.split("## The README's figures", 1)[1].split("\n## ", 1)[0]


def unmeasured_figures(readme: str, table: str) -> list[str]:
    """Figures the README states that the table has no row for."""
    rows = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    return [f for f in FIGURE.findall(readme) if f not in rows]


def test_every_figure_the_readme_states_is_a_measured_row():
    found = FIGURE.findall(_readme())
    assert found, "the README states no figure this test recognises: FIGURE no longer matches how it writes them"
    missing = unmeasured_figures(_readme(), _figures_table())
    assert not missing, f"README figures with no row in docs/performance.md's table of what measured them: {missing}"


def test_a_changed_figure_is_caught():
    """The check above on a deliberate violation: the README says 3 minutes where the table measured 2."""
    table = _figures_table()
    assert unmeasured_figures(_readme().replace("about 2 minutes", "about 3 minutes"), table) == [
        "about 3 minutes and 5 GB"
    ]


def test_the_venv_is_the_size_the_readme_says():
    """Measured on the environment this run uses, when it is the ``.venv`` ``scripts/install.sh`` builds; the
    README states whole GB, so the measurement rounds to it."""
    venv = Path(sys.prefix)
    if venv != REPO_ROOT / ".venv":
        pytest.skip(f"this run's environment is {venv}, not the repository's .venv the README describes")
    [stated] = re.findall(r"about \d+ minutes and (\d+) GB", _readme())
    size = sum(p.lstat().st_size for p in venv.rglob("*") if not p.is_symlink() and p.is_file())
    assert round(size / 1e9) == int(stated), f".venv holds {size / 1e9:.2f} GB; the README says {stated} GB"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_engine_version_the_readme_names_is_one_installed(engine):
    dist = ENGINES[engine]
    lanes = sorted((REPO_ROOT / "requirements").glob(f"consumers-{dist}*.txt"))
    pinned = {v for f in lanes for v in re.findall(rf"^{dist}==(\S+)", f.read_text(), flags=re.M)}
    named = re.findall(rf"\b{engine} (\d+(?:\.\d+)+)", _readme())
    assert named, f"the README no longer names {engine}'s version"
    wrong = [v for v in named if not any(p == v or p.startswith(v + ".") for p in pinned)]
    assert not wrong, (
        f"the README names {engine} {wrong}; its lanes ({[f.name for f in lanes]}) install {sorted(pinned)}"
    )
    missing = [p for p in pinned if not any(p == v or p.startswith(v + ".") for v in named)]
    assert not missing, f"{engine} {missing} has a lane the README does not name"
