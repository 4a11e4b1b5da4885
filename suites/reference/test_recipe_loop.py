"""The loop a LoRA job runs all day, on the Flash recipe's tiny variant: train, checkpoint every
2 steps, publish to disk every 2 steps, get killed, resume from the newest complete checkpoint, finish; through the
public API only (``fixtures/recipe_rank_fns.rank_recipe_loop``), PP=2 on two CPU ranks as the recipe lays it out.

The job killed after step 5 (its last rank SIGKILLed; the other stranded in the pipeline and stopped) and run again
must end where an uninterrupted job ends: the same losses for every step after the resume, the same adapter bit for
bit, and the same adapter published as current.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch
from safetensors.torch import load_file

import fixtures.asserts as ah
from fixtures.ranks.recipe_rank_fns import RecipeLoopCase, rank_recipe_loop
from fixtures.runner.multirank import RankFailure, impl_preload, run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

KILL_AT = 5  # after the checkpoints of steps 2 and 4: the resume must pick step 4's


def test_the_tiny_recipe_killed_and_resumed_ends_as_an_uninterrupted_job_and_publishes_the_same_adapter(impl, tmp_path):
    from tiny_models.oracle import write_checkpoint

    tiny = impl.tiny_variant()
    recipe = dataclasses.replace(tiny, checkpoint=str(write_checkpoint(tiny.preset, tmp_path / "base", seed=3)))
    whole = run_ranks(rank_recipe_loop, RecipeLoopCase(impl.name, recipe, str(tmp_path / "whole")),
                      nproc=recipe.world_size, timeout_s=300, preload=impl_preload(impl.name))  # fmt: skip
    job = tmp_path / "job"
    run_ranks(rank_recipe_loop, RecipeLoopCase(impl.name, recipe, str(job), kill_at=KILL_AT), nproc=recipe.world_size,
              timeout_s=300, grace_s=5.0, preload=impl_preload(impl.name),
              expect=RankFailure(rank=recipe.world_size - 1, signal=signal.SIGKILL))  # fmt: skip
    after_kill = impl.resolve_current(job / "published")
    impl.validate_adapter_dir(after_kill, base=recipe.checkpoint)
    resumed = run_ranks(rank_recipe_loop, RecipeLoopCase(impl.name, recipe, str(job)), nproc=recipe.world_size,
                        timeout_s=300, preload=impl_preload(impl.name))  # fmt: skip
    for w, r in zip(whole, resumed, strict=True):
        assert r.payload["started_after"] == 4, f"rank {r.rank}: resumed after step {r.payload['started_after']}"
        for step, loss in r.payload["losses"].items():
            assert loss == w.payload["losses"][step], (
                f"rank {r.rank} step {step}: {loss!r} vs {w.payload['losses'][step]!r}"
            )
    ah.assert_state_dicts_bitwise_equal(
        {n: torch.from_numpy(a) for n, a in resumed[0].payload["adapter"].items()},
        {n: torch.from_numpy(a) for n, a in whole[0].payload["adapter"].items()},
        context="the resumed job's final adapter vs the uninterrupted job's",
    )
    current = {d: impl.resolve_current(tmp_path / d / "published") for d in ("whole", "job")}
    assert current["job"] != after_kill, "the resumed job published nothing after the kill"
    impl.validate_adapter_dir(current["job"], base=recipe.checkpoint)
    ah.assert_state_dicts_bitwise_equal(
        load_file(str(current["job"] / "adapter_model.safetensors")),
        load_file(str(current["whole"] / "adapter_model.safetensors")),
        context="the adapter published as current",
    )
