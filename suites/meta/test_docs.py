"""The documentation is self-contained: nothing in the project points outside it, and every citation of a
``docs/`` file (and of a section ``§N`` in it) resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fixtures.runner.subproc import REPO_ROOT

pytestmark = pytest.mark.cpu

SCANNED = (
    "impl",
    "implementations",
    "suites",
    "fixtures",
    "tiny_models",
    "docs",
    "recipes",
    "scripts",
    ".ci",
    "README.md",
    "conftest.py",
)
SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".ini", ".yaml", ".sbatch", ""}
# a URL, a path out of the repository, or a bare name of a reference note that only exists outside it
OUTSIDE = re.compile(
    r"https?://|\.\./shared|shared/reference|/work/|research/"
    r"|(?<!docs/reference/)\b(?:v4_architecture|perf_anchors|cpu_environment|miles_v4_lora|house_style)\.md"
)
CITATION = re.compile(r"(docs/[\w/.-]+\.md)`{0,2}(?: §(\d+(?:\.\d+)?))?")


def _files(root: Path) -> list[Path]:
    found = []
    for entry in SCANNED:
        target = root / entry
        candidates = target.rglob("*") if target.is_dir() else [target]
        found += [p for p in candidates if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return sorted(found)


def _lines(root: Path):
    for path in _files(root):
        if path.resolve() == Path(__file__).resolve():
            continue  # its patterns name what they look for
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            yield path.relative_to(root).as_posix(), number, line


def test_nothing_in_the_project_links_outside_it():
    outside = [f"{path}:{n}: {line.strip()[:100]}" for path, n, line in _lines(REPO_ROOT) if OUTSIDE.search(line)]
    assert not outside, "links or paths outside the project (bring the fact into docs/):\n  " + "\n  ".join(outside)


def _sections(doc: Path) -> set[str]:
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", doc.read_text(), flags=re.M))


def test_every_cited_document_and_section_exists():
    broken = []
    for path, n, line in _lines(REPO_ROOT):
        for doc, section in CITATION.findall(line):
            target = REPO_ROOT / doc
            if not target.is_file():
                broken.append(f"{path}:{n}: {doc} does not exist")
            elif section and section not in _sections(target):
                broken.append(f"{path}:{n}: {doc} has no section {section}")
    assert not broken, "citations that do not resolve:\n  " + "\n  ".join(broken)


#: the project's own tracker, which an outsider cannot resolve ("issue 14", "issues 3 and 4"); upstream pull
#: requests (Megatron-Bridge #4306) are public and may be cited
TRACKER = re.compile(r"\bissues? \d+\b", re.I)
CODE = ("impl", "implementations", "suites", "fixtures", "tiny_models", "scripts", ".ci", "recipes", "conftest.py")


def tracker_citations(lines) -> list[str]:
    return [f"{path}:{n}: {line.strip()[:100]}" for path, n, line in lines if TRACKER.search(line)]


def test_code_cites_no_tracker_numbers():
    code = [(p, n, line) for p, n, line in _lines(REPO_ROOT) if p.split("/")[0] in CODE or p in CODE]
    found = tracker_citations(code)
    assert not found, "code citing this project's tracker (say why in words; history is in commits):\n  " + "\n  ".join(
        found
    )


def test_a_tracker_citation_is_caught():
    lines = [(".ci/run", 58, "# ---- GPU suite rehearsal (issue 14) ----"), ("impl/x.py", 3, "# Megatron-Bridge #4306")]
    assert tracker_citations(lines) == [".ci/run:58: # ---- GPU suite rehearsal (issue 14) ----"]
