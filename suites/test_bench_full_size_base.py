"""Benchmark: ``verify-adapter`` and ``coverage`` on a DeepSeek-V4-Flash-size base (the sparse sharded checkpoint of
``fixtures/sparse_checkpoint.py``: the Flash manifest's ~69k tensors, ~160 GB on paper, holes on disk).

Each command runs :data:`REPEATS` times in a fresh interpreter, as a user runs it; printed per run: exit status, wall
time, CPU time (user + sys, every thread) and peak RSS, from ``wait4``, each against its goal: under
:data:`CPU_GOAL_S` of CPU time and :data:`RSS_GOAL_BYTES` of peak RSS, in the better of the runs. CPU time is the
figure that matters because a shared host's wall time also counts waiting for a core. A mismatching base (one byte of
one targeted weight changed) is timed too: the fingerprint must hash the targeted bytes without reading the rest.
What the commands answer is ``suites/test_full_size_base.py``'s to judge. Run explicitly::

    .venv/bin/python -m pytest -q -s -m bench suites/test_bench_full_size_base.py

Prints figures; never asserts on time or memory.
"""

from __future__ import annotations

import os
import sys

import pytest

from fixtures.sparse_checkpoint import SparseFlash, poked_copy
from fixtures.subproc import Usage, run_measured

pytestmark = pytest.mark.bench

REPEATS = 2
CPU_GOAL_S = 10.0
RSS_GOAL_BYTES = 10**9


def _verdict(runs: list[Usage]) -> str:
    """The better run's figures against the goals, flagged where a goal is missed."""
    cpu, rss = min(u.cpu_s for u in runs), min(u.max_rss_bytes for u in runs)
    flags = [f"CPU {cpu:.1f} s (goal < {CPU_GOAL_S:g} s){'' if cpu < CPU_GOAL_S else '  OVER GOAL'}"]
    flags.append(f"peak RSS {rss / 1e6:.0f} MB (goal < {RSS_GOAL_BYTES / 1e6:.0f} MB)")
    flags[-1] += "" if rss < RSS_GOAL_BYTES else "  OVER GOAL"
    return "best of runs: " + ", ".join(flags)


def test_bench_verify_adapter_and_coverage_on_a_flash_size_base(impl, flash_sparse: SparseFlash, tmp_path) -> None:
    poked_copy(flash_sparse.base, tmp_path / "poked", "layers.42.attn.wo_b.weight")
    adapter = ("--adapter", flash_sparse.adapter)
    commands = {
        "verify-adapter": ("verify-adapter", "--base", flash_sparse.base, *adapter),
        "verify-adapter, 1 byte changed": ("verify-adapter", "--base", tmp_path / "poked", *adapter),
        "coverage --base": ("coverage", "--base", flash_sparse.base),
    }
    print(
        f"\nFlash-size base: {flash_sparse.tensors} tensors, {flash_sparse.logical_bytes / 1e9:.0f} GB on paper; "
        f"adapter: {flash_sparse.adapter_tensors} tensors; host: {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for label, args in commands.items():
        runs = []
        for i in range(REPEATS):
            result, usage = run_measured([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=600)
            runs.append(usage)
            print(f"  {label:<32} run {i + 1}: exit {result.returncode}, {usage}")
        print(f"  {label:<32} {_verdict(runs)}")
