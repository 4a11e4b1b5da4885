"""The conformance suites prove their power on implementations wrong on purpose: the one that implements nothing
(``implementations/empty``) passes no test, every test failing with ``DriverMissing`` before it runs (its known gaps,
strict), and its generated report is what that run gives; one whose export drops PEFT's key prefix
(``implementations/wrong/unprefixed.py``) is caught by the export suite, which names the problem. The other reports
(docs/conformance/) take minutes each: ``scripts/conformance_report.py --check`` runs them."""

from __future__ import annotations

import re
import sys

import pytest

from fixtures.contract.conformance import VERSIONS, installed_version, render_report, report_doc, run_conformance
from fixtures.runner.subproc import REPO_ROOT, run

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.harness]

EMPTY = "implementations.empty"


def test_an_implementation_of_nothing_passes_no_test_and_its_report_is_current():
    doc = report_doc(EMPTY)
    section = doc.section(doc.path.read_text())
    assert section is not None, f"{doc.path} lost its generated-section markers"
    conformance = run_conformance(EMPTY)
    assert conformance.returncode == 0, (
        f"{EMPTY} did not meet implementations/empty/xfails.txt (pytest exit {conformance.returncode}): some test "
        f"did not fail with DriverMissing\n{conformance.output[-5000:]}"
    )
    passed = [o.test for o in conformance.outcomes if o.outcome != "known gap"]
    assert conformance.outcomes and not passed, f"an implementation of nothing did not fail these: {passed}"
    versions = dict(re.findall(r"(\S+) (\S+?)[,.](?: |$)", section.split("Run on ", 1)[1].split("\n", 1)[0]))
    if any(versions.get(d) != installed_version(d) for d in VERSIONS):
        pytest.skip(f"the report is of {versions}; this lane runs other versions")
    assert section == render_report(conformance), (
        f"{doc.path.name} is stale: run '.venv/bin/python scripts/conformance_report.py --write --driver {EMPTY}'"
    )


def test_an_export_without_peft_prefix_is_caught_and_named():
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", "--tb=line"]
    argv += ["--driver", "implementations.wrong.unprefixed", "suites/export", "-k", "valid_adapter and dp"]
    done = run(argv, timeout=600, cwd=REPO_ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 1, f"the export suite did not fail on an unprefixed export:\n{output[-3000:]}"
    assert "keys not of PEFT's form base_model.model.<module>.lora_A|B.weight" in output, output[-3000:]
