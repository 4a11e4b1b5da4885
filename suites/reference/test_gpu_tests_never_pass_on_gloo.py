"""No false green: a ``gpu``-marked multi-rank test runs on NCCL ranks or not at all.

Each test runs pytest in a fresh interpreter on a probe file (a ``gpu``-marked test whose two ranks all-reduce a
CPU tensor, which passes on gloo) with the suite's conftest loaded as a plugin:

* on this CPU-only host the probe is skipped with the reason, never passed;
* on a host that claims CUDA (``torch.cuda`` patched in the pytest process only; its spawned ranks see the real,
  GPU-less torch) the runner spawns NCCL ranks: they cannot start here, so the probe fails, where a gloo runner
  would have passed it;
* ``--rehearse`` outside torchrun is a usage error naming the torchrun command (the rehearsal never spawns);
* inside a launched world whose default group is gloo, a GPU-world call raises instead of running on that group.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fixtures.runner.multirank import GPU_WORLD, rank_world, run_ranks
from fixtures.runner.subproc import REPO_ROOT, pytest_outcomes, run

pytestmark = [pytest.mark.cpu, pytest.mark.harness]  # the runner's guard: no Bridge pin changes it

PROBE = """
import pytest
import torch
import torch.distributed as dist

from fixtures.runner.multirank import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]


def _rank_backend(rank, world_size, case):
    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_backend(), total.item()


def test_probe_ranks_all_reduce(nproc):
    results = run_ranks(_rank_backend, None, nproc=nproc, timeout_s=60)
    print("probe backends:", [r.payload for r in results])
"""

CLAIM_CUDA = """
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
"""

PROBE_ID = "test_probe.py::test_probe_ranks_all_reduce"


def _pytest(tmp_path: Path, *args: str) -> tuple[int, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "claim_cuda.py").write_text(CLAIM_CUDA)
    argv = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA", "--nproc", "2"]
    argv += ["--rootdir", str(tmp_path), "-m", "gpu", *args, str(tmp_path / "test_probe.py")]
    result = run(argv, timeout=240, cwd=tmp_path, env={"PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"})
    return result.returncode, result.stdout + result.stderr


def test_gpu_marked_multirank_test_without_cuda_is_skipped_with_the_reason(tmp_path):
    code, output = _pytest(tmp_path)
    summary = output.strip().splitlines()[-1]
    assert "1 skipped" in summary and "passed" not in summary, f"the probe was not skipped:\n{output}"
    assert "needs CUDA" in output and "--rehearse" in output, (
        f"the skip does not say why, or how to rehearse:\n{output}"
    )
    assert code == 0, output


def test_gpu_marked_multirank_test_on_a_cuda_host_runs_nccl_ranks_never_gloo(tmp_path):
    code, output = _pytest(tmp_path, "-p", "claim_cuda")
    outcome = pytest_outcomes(output).get(PROBE_ID)
    assert outcome == "FAILED", f"the probe {outcome} without GPUs: its ranks were not NCCL ranks:\n{output}"
    assert "nccl" in output.lower() or "cuda" in output.lower(), f"the failure does not name NCCL/CUDA:\n{output}"
    assert "probe backends" not in output, f"the probe's ranks ran:\n{output}"
    assert code == 1, output


def test_rehearse_outside_torchrun_is_a_usage_error_naming_the_command(tmp_path):
    code, output = _pytest(tmp_path, "--rehearse")
    assert code == 4, f"exit {code}, expected pytest's usage error (4):\n{output}"
    assert "torchrun --nproc-per-node" in output and "--rehearse" in output, output


def _rank_sum(rank: int, world_size: int, case: None) -> float:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def _rank_gpu_call_on_a_gloo_world(rank: int, world_size: int, case: None) -> str:
    # A spawned rank is a launched world whose default group is gloo, as a torchrun session would be after a CPU test.
    with rank_world(GPU_WORLD, label="gpu-call"):
        try:
            results = run_ranks(_rank_sum, None, nproc=world_size, timeout_s=20)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return f"ran on the gloo group: {[r.payload for r in results]}"


def test_a_gpu_call_in_a_launched_world_never_runs_on_its_gloo_group():
    for r in run_ranks(_rank_gpu_call_on_a_gloo_world, None, nproc=2, timeout_s=40):
        assert r.payload.startswith("BackendMismatch: this call asks for the nccl backend"), (
            f"rank {r.rank}: {r.payload}"
        )
        assert "gloo" in r.payload, f"rank {r.rank}: {r.payload}"
