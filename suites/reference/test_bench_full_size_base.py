"""Benchmark: ``verify-adapter`` and ``coverage`` on a DeepSeek-V4-Flash-size base (the sparse sharded checkpoint of
``fixtures/data/sparse_checkpoint.py``: the Flash manifest's ~69k tensors, ~160 GB on paper, holes on disk).

Each command runs in a fresh interpreter, as a user runs it; printed per run: exit status, wall time, CPU time
(user + sys, every thread) and peak RSS, from ``wait4``, against the goals (:data:`WALL_GOAL_S`, :data:`RSS_GOAL_BYTES`)
and next to the floor: a bare interpreter reading the same headers as JSON. ``verify-adapter`` runs on a base's
first check (an empty digest cache: each large targeted weight compared by its sampled pages, docs/fingerprint.md),
with ``--full-hash`` (the 4.4 GB of targeted weights hashed, their digests remembered: :mod:`impl.conversion.digests`)
and after it (every byte compared, by the remembered digests); a mismatching base (one byte of one targeted weight
changed in a shard written just now) is compared by samples and then hashed. What the commands answer is ``suites/reference/test_full_size_base.py``'s to judge. Run explicitly::

    .venv/bin/python -m pytest -q -s -m bench suites/reference/test_bench_full_size_base.py

Prints figures; never asserts on time or memory.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from fixtures.data.sparse_checkpoint import SparseFlash, poked_copy
from fixtures.runner.subproc import Usage, run_measured

pytestmark = pytest.mark.bench

WALL_GOAL_S = 2.0
RSS_GOAL_BYTES = 400 * 10**6
#: a bare read of every shard's header: what judging a base by its headers cannot go below
_FLOOR = """
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    with open(f, "rb") as fh:
        json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
"""


def _line(label: str, result_code: int, usage: Usage) -> str:
    over = [
        what
        for what, bad in (("wall", usage.wall_s > WALL_GOAL_S), ("RSS", usage.max_rss_bytes > RSS_GOAL_BYTES))
        if bad
    ]
    flag = f"  OVER GOAL ({', '.join(over)})" if over else ""
    return f"  {label:<40} exit {result_code}, {usage}{flag}"


def test_bench_verify_adapter_and_coverage_on_a_flash_size_base(impl, flash_sparse: SparseFlash, tmp_path) -> None:
    poked_copy(flash_sparse.base, tmp_path / "poked", "layers.42.attn.wo_b.weight")
    adapter = ("--adapter", flash_sparse.adapter)
    cli = [sys.executable, "-m", f"{impl.name}.cli"]
    env = dict(os.environ, DSV4_LORA_CACHE=str(tmp_path / "digests"))
    time.sleep(1.1)  # the base's shards settle (a shard written within a second is never remembered)
    runs = {
        "floor: a bare read of the headers": [sys.executable, "-c", _FLOOR, flash_sparse.base],
        "verify-adapter, a base's first": [*cli, "verify-adapter", "--base", flash_sparse.base, *adapter],
        "verify-adapter, first again": [*cli, "verify-adapter", "--base", flash_sparse.base, *adapter],
        "verify-adapter --full-hash, cold": [
            *cli,
            "verify-adapter",
            "--full-hash",
            "--base",
            flash_sparse.base,
            *adapter,
        ],
        "verify-adapter, digests remembered": [*cli, "verify-adapter", "--base", flash_sparse.base, *adapter],
        "verify-adapter, 1 byte changed": [*cli, "verify-adapter", "--base", tmp_path / "poked", *adapter],
        "verify-adapter --full-hash, 1 byte changed": [
            *cli,
            "verify-adapter",
            "--full-hash",
            "--base",
            tmp_path / "poked",
            *adapter,
        ],
        "coverage --base": [*cli, "coverage", "--base", flash_sparse.base],
        "coverage --base, again": [*cli, "coverage", "--base", flash_sparse.base],
    }
    print(
        f"\nFlash-size base: {flash_sparse.tensors} tensors, {flash_sparse.logical_bytes / 1e9:.0f} GB on paper; "
        f"adapter: {flash_sparse.adapter_tensors} tensors; host: {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}; goals: wall <= {WALL_GOAL_S:g} s, "
        f"peak RSS <= {RSS_GOAL_BYTES / 1e6:.0f} MB"
    )
    for label, argv in runs.items():
        result, usage = run_measured([str(a) for a in argv], timeout=600, env=env)
        print(_line(label, result.returncode, usage))
