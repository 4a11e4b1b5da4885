"""qualify's steps before the files are written (the adapter's gather, the base's fingerprint) are part of the
collective export: one rank failing there is reported by every rank, within the timeout, and nothing is published.

Each rank of a two-rank gloo world runs qualify's own rank function (``dsv4_lora.qualify_driver_rank``, through the
implementation's driver) in-process, with one public function made to fail on one rank
(``fixtures.ranks.faults.fail_on_rank``): the fault sits where qualify really calls it, not behind a test switch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fixtures.ranks.faults import InjectedFault, fail_on_rank
from fixtures.runner.impl_loader import load_impl
from fixtures.runner.multirank import impl_preload, run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.slow]

QUALIFY_TIMEOUT_S = 120.0  # the export's exchange waits a quarter of it for a peer


@dataclass(frozen=True)
class FaultCase:
    impl_name: str
    base: str
    out: str
    fail_rank: int
    function: str  # a public function of the implementation that qualify calls


#: (failing rank, public function): the gather on a reader rank and on the writer; the fingerprint, which only the
#: writer computes
CASES = ((1, "gather_adapter_state"), (0, "gather_adapter_state"), (0, "base_fingerprint"))


def _rank_qualify_with_fault(rank: int, world_size: int, case: FaultCase) -> dict:
    from dsv4_conformance.driver import Layout, LoraSpec
    from dsv4_lora.qualify_driver_rank import DriverRun, qualify_driver_rank

    api = load_impl(case.impl_name)
    getattr(api.module, case.function)  # resolve the lazy name so the patch replaces the attribute itself
    lora = LoraSpec(("wq_a", "wo_b"), 4, 8.0)
    run = DriverRun(f"{case.impl_name}.driver", case.base, case.out + "/adapter", Layout(), lora, steps=1)
    run = replace(run, timeout_s=QUALIFY_TIMEOUT_S)
    start = time.monotonic()
    with fail_on_rank(case.fail_rank, api.module, case.function):
        found = qualify_driver_rank(rank, world_size, run)
    return {"error": found["errors"].get("export"), "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("fail_rank,function", CASES, ids=[f"{f}-on-rank{r}" for r, f in CASES])
def test_a_failure_before_the_files_are_written_is_every_ranks_error_and_publishes_nothing(
    impl, tiny_ckpt_factory, tmp_path: Path, fail_rank: int, function: str
) -> None:
    out = tmp_path / "q"
    case = FaultCase(impl.name, str(tiny_ckpt_factory()), str(out), fail_rank, function)
    results = run_ranks(
        _rank_qualify_with_fault, case, nproc=2, timeout_s=2 * QUALIFY_TIMEOUT_S, preload=impl_preload(impl.name)
    )
    injected = f"rank {fail_rank}: {InjectedFault.__name__}: injected fault on rank {fail_rank}"
    for rank, r in enumerate(results):
        error, elapsed = r.payload["error"], r.payload["elapsed"]
        assert error is not None, f"rank {rank}: qualify's export passed although rank {fail_rank}'s {function} failed"
        assert "CollectiveExportError" in error and injected in error, f"rank {rank} does not name the cause: {error}"
        assert elapsed < QUALIFY_TIMEOUT_S, f"rank {rank} took {elapsed:.0f}s: it waited for a peer that had failed"
    leftovers = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not any(name == "adapter" or name.startswith(".adapter") for name in leftovers), (
        f"{function} failed on rank {fail_rank}, yet {out} holds {leftovers}"
    )
