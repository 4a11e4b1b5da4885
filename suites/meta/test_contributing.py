"""``CONTRIBUTING.md`` stays true: every file it tells a contributor to touch exists, and the target lists it says
must agree (the implementation's vocabulary, the driver contract's, the judge's own, the reference suite's
hand-written one, the golden vectors') name the same targets, so adding a target to one and not the others fails
here, by name."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from dsv4_conformance.driver import MAIN_ATTENTION
from dsv4_conformance.judge.artifacts import TRANSFORMERS_LEAF
from tiny_models import golden

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "CONTRIBUTING.md"
_PATH = re.compile(r"`([\w.*-]+/[\w./*<>-]*|[\w-]+\.(?:py|md|txt|toml))`")


def _named_paths() -> list[str]:
    return sorted(set(_PATH.findall(GUIDE.read_text())))


def test_every_file_the_guide_names_exists():
    missing = []
    for path in _named_paths():
        if "<" in path:  # a placeholder (implementations/<name>/...): the folder it sits in must exist
            path = path.split("<")[0].rsplit("/", 1)[0]
        if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
            missing.append(path)
    assert _named_paths() and not missing, f"CONTRIBUTING.md names files that do not exist: {missing}"


def test_the_readme_points_to_the_guide():
    assert "CONTRIBUTING.md" in (ROOT / "README.md").read_text(), "the README does not link CONTRIBUTING.md"


def test_every_target_list_the_guide_names_agrees(impl):
    spec = importlib.util.spec_from_file_location("vocab_test", ROOT / "suites/reference/test_target_vocabulary.py")
    hand_written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hand_written)
    lists = {
        "impl TARGET_TABLE (main rows)": tuple(row.official for row in impl.TARGET_TABLE.main),
        "dsv4_conformance.driver.MAIN_ATTENTION": MAIN_ATTENTION,
        "dsv4_conformance.judge TRANSFORMERS_LEAF": tuple(TRANSFORMERS_LEAF),
        "suites/reference/test_target_vocabulary.py MAIN": hand_written.MAIN,
        "tiny_models.golden TARGETS (the golden vectors)": golden.TARGETS,
    }
    sets = {name: set(targets) for name, targets in lists.items()}
    first = next(iter(sets.values()))
    differ = {name: sorted(s ^ first) for name, s in sets.items() if s != first}
    assert not differ, f"the target lists disagree (symmetric difference with the first): {differ}"
