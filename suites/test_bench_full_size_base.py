"""Benchmark: ``verify-adapter`` and ``coverage`` on a DeepSeek-V4-Flash-size base (the sparse sharded checkpoint of
``fixtures/sparse_checkpoint.py``: the Flash manifest's ~69k tensors, ~160 GB on paper, holes on disk).

Each command runs :data:`REPEATS` times in a fresh interpreter, as a user runs it; printed per run: wall time, CPU
time (user + sys, every thread) and peak RSS, from ``wait4``. The goal (``suites/test_full_size_base.py`` asserts
it on CPU time): under 10 s and under 1 GB each. Run explicitly::

    .venv/bin/python -m pytest -q -s -m bench suites/test_bench_full_size_base.py

Prints figures; never asserts on time.
"""

from __future__ import annotations

import os
import sys

import pytest

from fixtures.sparse_checkpoint import SparseFlash
from fixtures.subproc import run_measured

pytestmark = pytest.mark.bench

REPEATS = 2


def test_bench_verify_adapter_and_coverage_on_a_flash_size_base(impl, flash_sparse: SparseFlash) -> None:
    commands = {
        "verify-adapter": ("verify-adapter", "--base", flash_sparse.base, "--adapter", flash_sparse.adapter),
        "coverage --base": ("coverage", "--base", flash_sparse.base),
    }
    print(
        f"\nFlash-size base: {flash_sparse.tensors} tensors, {flash_sparse.logical_bytes / 1e9:.0f} GB on paper; "
        f"adapter: {flash_sparse.adapter_tensors} tensors; host: {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for label, args in commands.items():
        for i in range(REPEATS):
            result, usage = run_measured([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=600)
            print(f"  {label:<16} run {i + 1}: exit {result.returncode}, {usage}")
