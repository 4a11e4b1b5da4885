"""The worked example of docs/implementing.md: Megatron-Bridge's own LoRA (``implementations/bridge_lora``) run
under the suites of the capability it declares meets exactly its strict known gaps, and its generated report
(docs/conformance/bridge_lora.md) is what that run gives."""

from __future__ import annotations

import re

import pytest

from fixtures.contract.conformance import installed_version, render_report, report_doc, run_conformance

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.harness]

EXAMPLE = "implementations.bridge_lora"


def test_the_worked_example_meets_its_known_gaps_and_its_report_is_current():
    doc = report_doc(EXAMPLE)
    section = doc.section(doc.path.read_text())
    assert section is not None, f"{doc.path} lost its generated-section markers"
    reported = re.search(r"megatron-bridge (\S+),", section)
    if reported and reported.group(1) != installed_version("megatron-bridge"):
        pytest.skip(
            f"the report is of megatron-bridge {reported.group(1)}; {installed_version('megatron-bridge')} is installed"
        )
    run = run_conformance(EXAMPLE)
    assert run.returncode == 0, (
        f"{EXAMPLE} under its declared capabilities did not meet implementations/bridge_lora/xfails.txt "
        f"(pytest exit {run.returncode}): a gap closed or a test fails another way\n{run.output[-5000:]}"
    )
    assert section == render_report(run), (
        f"{doc.path.name} is stale: run '.venv/bin/python scripts/conformance_report.py --write'"
    )
