"""The DeepSeek-V4-Flash LoRA recipe on the real checkpoint across 32 ranks (4 nodes x 8 GPUs, TP=1 PP=4 EP=8).

Run as ranks (each pytest process is one rank; ``run_ranks`` runs in-process on NCCL)::

    DSV4_RUN=gpu32 DSV4_FLASH_CHECKPOINT=/data/DeepSeek-V4-Flash sbatch recipes/launch_slurm.sbatch

Skipped without CUDA (conftest) and without ``$DSV4_FLASH_CHECKPOINT`` (reason printed with ``-rs``).
One build per session (``fixtures/ranks/recipe_rank_fns.py``, which ``suites/reference/test_recipe.py`` also runs on the tiny
variant on two CPU ranks): strict load, a few Adam steps on the adapters, adapter-only export, then the
``dsv4-lora verify-adapter`` command line on the published directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fixtures.ranks.recipe_rank_fns import RecipeRunCase, rank_lora_recipe
from fixtures.runner.multirank import impl_preload, launched_world, run_ranks
from fixtures.runner.subproc import REPO_ROOT, run

pytestmark = [pytest.mark.gpu32, pytest.mark.multirank]

TIMEOUT_S = 3 * 3600  # loading 160 GB of FP8/FP4 shards dominates


@pytest.fixture(scope="module")
def flash_recipe(impl):
    if not os.environ.get("DSV4_FLASH_CHECKPOINT"):
        pytest.skip("DSV4_FLASH_CHECKPOINT is not set: point it at the official DeepSeek-V4-Flash checkpoint")
    recipe = impl.deepseek_v4_flash_lora_recipe()
    world = launched_world()
    if world is None or world.world_size != recipe.world_size:
        pytest.skip(f"run under torchrun with {recipe.world_size} ranks (recipes/launch_slurm.sbatch, DSV4_RUN=gpu32)")
    return recipe


@pytest.fixture(scope="module")
def flash_run(impl, flash_recipe):
    # The same directory on every rank (shared filesystem): torchrun's rendezvous id names it.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    out = Path(os.environ.get("DSV4_OUT", REPO_ROOT / "out")) / f"gpu32-{run_id}" / "adapter"
    case = RecipeRunCase(impl.name, flash_recipe, str(out))
    results = run_ranks(rank_lora_recipe, case, nproc=flash_recipe.world_size, timeout_s=TIMEOUT_S,
                        preload=impl_preload(impl.name))  # fmt: skip
    return case, results


def test_flash_recipe_loads_the_real_checkpoint_strictly_on_every_rank(flash_run):
    _, results = flash_run
    for r in results:
        t = r.payload["load_totals"]
        assert t["unmapped"] == 0 and t["missing"] == 0 and t["native_filled"] > 0, f"rank {r.rank}: load totals {t}"


def test_flash_recipe_lora_updates_are_finite_and_nonzero_on_every_rank(flash_run):
    _, results = flash_run
    for r in results:
        p = r.payload
        assert p["updates"], f"rank {r.rank}: no trainable adapter parameters"
        assert all(abs(x) < float("inf") for x in p["losses"]), f"rank {r.rank}: non-finite loss {p['losses']}"
        bad = [n for n, (delta, finite) in p["updates"].items() if not finite or delta == 0.0]
        assert not bad, f"rank {r.rank}: adapters with no or non-finite update: {bad[:10]}"


def test_flash_recipe_adapter_passes_verify_adapter_cli(impl, flash_run, flash_recipe):
    case, _ = flash_run
    if launched_world().rank != 0:
        pytest.skip("rank 0 checks the published adapter")
    adapter = Path(case.out)
    assert (adapter / ".complete").exists(), f"export did not publish {adapter}"
    cli = [
        sys.executable,
        "-m",
        f"{impl.name}.cli",
        "verify-adapter",
        "--base",
        flash_recipe.checkpoint,
        "--adapter",
        adapter,
    ]
    result = run([str(a) for a in cli], timeout=1800)
    assert result.returncode == 0, (
        f"verify-adapter failed on {adapter}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
