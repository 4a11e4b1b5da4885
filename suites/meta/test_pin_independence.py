"""The pin-independent files (run once, not per Megatron-Bridge pin): the list names real test files, and the blocker
``scripts/run_pin.sh independent`` puts first on PYTHONPATH really makes megatron unimportable, in a subprocess too,
while the rest of the stack still imports."""

from __future__ import annotations

import sys

import pytest

from fixtures.runner.pins import PIN_INDEPENDENT
from fixtures.runner.subproc import REPO_ROOT, run

pytestmark = pytest.mark.cpu

BLOCKER = REPO_ROOT / "fixtures" / "no_megatron"


def test_every_pin_independent_entry_is_a_test_file_with_a_reason():
    for path, why in PIN_INDEPENDENT.items():
        assert (REPO_ROOT / path).is_file() and path.startswith("suites/"), f"{path}: no such test file"
        assert why.strip(), f"{path}: say what it exercises without megatron"


@pytest.mark.parametrize("module", ["megatron", "megatron.core", "megatron.bridge"])
def test_the_blocker_makes_megatron_unimportable_in_a_subprocess(module):
    code = f"import torch, transformers\ntry:\n    import {module}\nexcept ImportError as e:\n    print('BLOCKED', e)\n"
    result = run([sys.executable, "-c", code], timeout=300, env={"PYTHONPATH": str(BLOCKER)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "BLOCKED megatron is blocked in this run" in result.stdout, f"{module} imported: {result.stdout[-500:]}"
