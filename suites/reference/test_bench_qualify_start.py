"""Benchmark: how long ``dsv4-lora qualify`` on the embedded default base takes, and where the time goes, on one rank
and on two (data parallel: the launcher, the collective export and the judge's share stand out).

Runs the command as a person does and prints its wall time, the CPU time of the command and its ranks (user +
system, from the children's resource usage: the host is shared, so wall time alone says little), the peak RSS of
the largest process, the host's load average, and each step's own timed progress line. Goal: under 30 s wall on
the 2-core CPU host. Run explicitly::

    .venv/bin/python -m pytest -q -s -m bench suites/reference/test_bench_qualify_start.py

Prints figures; never asserts on time.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import time

import pytest

from fixtures.runner.subproc import run

pytestmark = pytest.mark.bench

GOAL_WALL_S = 30.0
STEP_LINE = re.compile(r"^  \[\s*\d+/\d+\] .+ \.\.\. \d+\.\d+s$")


@pytest.mark.parametrize("how", [(), ("--nproc", "2")], ids=["one-rank", "two-ranks"])
def test_qualify_on_the_default_base_wall_and_cpu_time(impl, tmp_path, how):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", f"{impl.name}.cli", "qualify", *how, "--out", str(tmp_path / "q")]
    result = run(argv, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 0, f"qualify failed:\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(
        f"\nqualify {' '.join(how) or '(one rank)'} (default base): {wall:.1f}s wall (goal < {GOAL_WALL_S:g}s), {cpu:.1f}s CPU "
        f"(user {after.ru_utime - before.ru_utime:.1f}s + sys {after.ru_stime - before.ru_stime:.1f}s), "
        f"peak RSS {after.ru_maxrss / 1024:.0f} MiB; load average before {load[0]:.1f} on {os.cpu_count()} cores"
    )
    for line in result.stdout.splitlines():
        if STEP_LINE.match(line):
            print(line)
