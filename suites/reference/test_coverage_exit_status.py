"""``dsv4-lora coverage`` exits 1 when anything is unmapped or missing, as its help says: a base that lacks one
tensor the native model needs fails the command (its totals count it), while the complete base passes."""

from __future__ import annotations

import sys

import pytest
from safetensors.torch import load_file, save_file

from fixtures.runner.subproc import run
from tiny_models.oracle import write_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.slow]  # each run starts an interpreter that imports the command line

PRESET = "tiny-mixed"
DROPPED = "layers.1.attn.wkv.weight"


def _coverage(impl, base):
    argv = [sys.executable, "-m", f"{impl.name}.cli", "coverage", "--base", str(base), "--limit", "0"]
    return run(argv, timeout=300)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("coverage-exit")
    complete = write_checkpoint(PRESET, root / "complete", seed=0)
    lacking = write_checkpoint(PRESET, root / "lacking", seed=0)
    (file,) = lacking.glob("*.safetensors")
    tensors = load_file(str(file))
    assert DROPPED in tensors, f"the tiny base has no {DROPPED}: pick a tensor it holds"
    del tensors[DROPPED]
    save_file(tensors, str(file), metadata={"format": "pt"})
    return complete, lacking


def test_coverage_of_a_complete_base_exits_0(impl, bases):
    result = _coverage(impl, bases[0])
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


def test_coverage_of_a_base_missing_a_tensor_exits_1_counting_it(impl, bases):
    result = _coverage(impl, bases[1])
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert "missing 1" in result.stdout, result.stdout[-2000:]
