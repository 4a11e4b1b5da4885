"""A rank count that cannot hold the expert layout is an impossible argument like one that cannot hold the dense
layout: ``qualify`` exits 2 naming ``--nproc`` before it starts anything."""

from __future__ import annotations

import sys

import pytest

from fixtures.runner.subproc import run

pytestmark = [pytest.mark.cpu, pytest.mark.slow]  # starts an interpreter that imports the command line


def test_nproc_that_cannot_hold_the_expert_layout_exits_2(impl, tmp_path):
    out = tmp_path / "out"
    # 3 ranks hold TP=1 x PP=1 (dense) but not EP=2 x PP=1 (experts)
    argv = [sys.executable, "-m", f"{impl.name}.cli", "qualify", "--ep", "2", "--nproc", "3", "--out", str(out)]
    result = run(argv, timeout=300)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert "--nproc 3" in result.stderr and "EP=2" in result.stderr, result.stderr[-2000:]
    assert not (out / "qualify.json").exists(), "an impossible layout still started a qualify run"
