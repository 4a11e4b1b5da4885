"""Benchmark: exporting a DeepSeek-V4-Flash-sized adapter vs a plain ``safetensors.torch.save_file``.

Rank 16 on the five attention targets of 43 layers, real shapes, bf16 (~94 MB). Run explicitly:
``.venv/bin/python -m pytest -q -s -m bench suites/test_bench_export.py``. Prints medians, throughput, peak extra
RSS and ratios; never asserts on time. Targets: export <= 1.5x the plain save; peak extra memory < 2x the adapter
bytes. A second baseline, ``save_file`` followed by ``fsync``, shows what durability alone costs on this disk: the
export must fsync (its sync phase), the plain save does not.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.export_faults import load_export_module, make_native_adapter
from fixtures.multirank import run_ranks

pytestmark = pytest.mark.bench

FLASH = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_a": (8192, 4096), "wo_b": (4096, 8192)}
LAYERS, RANK, REPEATS = 43, 16, 3


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed_peak(fn) -> tuple[float, int]:
    """Wall time of ``fn()`` and its peak RSS above the RSS before it (sampled every 2 ms)."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss() - base)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    done.set()
    t.join()
    return elapsed, max(peak[0], _rss() - base)


@dataclass(frozen=True)
class BenchCase:
    root: str


def _rank_bench(rank: int, world_size: int, case: BenchCase) -> dict | None:
    import torch
    from safetensors.torch import save_file

    export = load_export_module()
    writer = rank == 0
    native = make_native_adapter(FLASH, LAYERS, RANK, dtype=torch.bfloat16) if writer else {}
    nbytes = sum(t.numel() * t.element_size() for t in native.values())
    state = export.AdapterState(native, r=RANK, alpha=32.0) if writer else None
    root = Path(case.root)
    plain, durable, exported = [], [], []

    def save_and_fsync(tensors: dict, path: Path) -> None:
        save_file(tensors, str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    for i in range(REPEATS):
        if writer:
            tensors, _ = export.publish_in_memory(state)  # same names; renaming is free (no copies)
            plain.append(_timed_peak(lambda i=i, t=tensors: save_file(t, str(root / f"plain{i}.safetensors"))))
            durable.append(_timed_peak(lambda i=i, t=tensors: save_and_fsync(t, root / f"durable{i}.safetensors")))
        exported.append(_timed_peak(lambda i=i: export.export_adapter(lambda: state, root / f"out{i}", timeout_s=120)))
    if not writer:
        return None
    return {"bytes": nbytes, "plain": plain, "durable": durable, "export": exported}


def _report(world_size: int, r: dict) -> None:
    mb = r["bytes"] / 2**20
    p_t, d_t, e_t = (statistics.median(t for t, _ in r[k]) for k in ("plain", "durable", "export"))
    p_m, e_m = (max(m for _, m in r[k]) / 2**20 for k in ("plain", "export"))
    print(
        f"\nexport bench ws={world_size}: adapter {mb:.1f} MiB, median of {REPEATS}\n"
        f"  plain save_file          {p_t * 1e3:6.0f} ms ({mb / p_t:5.0f} MiB/s, peak +{p_m:.0f} MiB)\n"
        f"  save_file + fsync        {d_t * 1e3:6.0f} ms ({mb / d_t:5.0f} MiB/s)\n"
        f"  export_adapter           {e_t * 1e3:6.0f} ms ({mb / e_t:5.0f} MiB/s, peak +{e_m:.0f} MiB)\n"
        f"  export / plain save      {e_t / p_t:6.2f}x (target <= 1.5x)\n"
        f"  export / save + fsync    {e_t / d_t:6.2f}x (the export must fsync: its sync phase)\n"
        f"  export peak / adapter    {e_m / mb:6.2f}x (target < 2x)"
    )


@pytest.mark.parametrize("world_size", [1, 4])
def test_export_of_a_flash_sized_adapter_against_a_plain_save(world_size: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_rank_bench, BenchCase(root), nproc=world_size, timeout_s=600)
        _report(world_size, results[0].payload)
