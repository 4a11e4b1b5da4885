"""The DeepSeek-V4-Flash LoRA recipe on the real checkpoint across 32 ranks (4 nodes x 8 GPUs, TP=1 PP=4 EP=8).

Run as ranks (each pytest process is one rank; ``run_ranks`` runs in-process on NCCL)::

    DSV4_RUN=gpu32 DSV4_FLASH_CHECKPOINT=/data/DeepSeek-V4-Flash sbatch recipes/launch_slurm.sbatch

Skipped without CUDA (conftest) and without ``$DSV4_FLASH_CHECKPOINT`` (reason printed with ``-rs``).
One build per session: strict load, a few Adam steps on the adapters, adapter-only export, then the
``dsv4-lora verify-adapter`` command line on the published directory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fixtures.multirank import impl_preload, launched_world, run_ranks
from fixtures.subproc import REPO_ROOT, run

pytestmark = [pytest.mark.gpu32, pytest.mark.multirank]

TRAIN_STEPS = 2
TIMEOUT_S = 3 * 3600  # loading 160 GB of FP8/FP4 shards dominates


@dataclass(frozen=True)
class FlashRunCase:
    recipe: Any  # impl.cli.recipe.DeepseekV4LoRARecipe (frozen, picklable)
    out: str
    steps: int = TRAIN_STEPS
    seed: int = 0


def rank_flash_lora_recipe(rank: int, world_size: int, case: FlashRunCase) -> dict:
    """Build the recipe's chunks [strict load, LoRA] -> DDP, train ``steps``, export the adapter."""
    import torch
    from transformers import AutoConfig

    from fixtures.impl_loader import load_impl
    from fixtures.multirank import init_megatron_parallel

    api = load_impl("impl")
    from impl.adapter.gather import gather_adapter_state

    recipe = case.recipe
    assert world_size == recipe.world_size, f"recipe wants {recipe.world_size} ranks, launched {world_size}"
    init_megatron_parallel(tp=recipe.tp, pp=recipe.pp, ep=recipe.ep)
    hf_config = AutoConfig.from_pretrained(recipe.checkpoint)
    reports: list = []

    def load_base(chunks):
        reports.append(api.load_official_checkpoint(chunks, recipe.checkpoint))
        return chunks

    lora_hook = api.make_lora_pre_wrap_hook(
        targets=list(recipe.targets), rank=recipe.lora_rank, alpha=recipe.lora_alpha, dropout=recipe.lora_dropout
    )
    chunks = api.build_native_model(
        hf_config,
        tp=recipe.tp,
        ep=recipe.ep,
        pp=recipe.pp,
        pipeline_layout=[list(stage) for stage in recipe.pipeline_layout],
        include_mtp=recipe.include_mtp,
        pre_wrap_hooks=[load_base, lora_hook],
        wrap_with_ddp=True,
    )
    (chunk,) = chunks
    adapters = {n: p for n, p in chunk.module.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.Adam(
        adapters.values(), lr=recipe.optimizer.lr, weight_decay=recipe.optimizer.weight_decay, eps=1e-8
    )
    device = next(iter(adapters.values())).device
    gen = torch.Generator().manual_seed(case.seed)
    pos = torch.arange(recipe.seq_length, device=device).unsqueeze(0)
    losses = []
    chunk.train()
    for _ in range(case.steps):
        ids = torch.randint(0, hf_config.vocab_size, (recipe.micro_batch_size, recipe.seq_length), generator=gen)
        ids = ids.to(device)
        opt.zero_grad(set_to_none=True)
        chunk.zero_grad_buffer()
        loss = api.ManualPipeline(chunk).run(ids, pos, labels=torch.roll(ids, -1, dims=1), backward=True)
        chunk.finish_grad_sync()
        for p in adapters.values():
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
        torch.nn.utils.clip_grad_norm_(adapters.values(), recipe.optimizer.clip_grad)
        opt.step()
        losses.append(float(loss.float().mean()))
    updates = {
        n: ((p.detach() - before[n]).abs().max().item(), bool(torch.isfinite(p).all())) for n, p in adapters.items()
    }
    state = gather_adapter_state(chunks, lora_hook.handle)
    names = [f"layers.{i}.attn.{t}.weight" for i in range(hf_config.num_hidden_layers) for t in recipe.targets]
    api.export_adapter(
        lambda: state,
        case.out,
        dialect="transformers",
        base_model_name_or_path=recipe.checkpoint,
        base_fingerprint=api.base_fingerprint(recipe.checkpoint, names),
        timeout_s=1800,
    )
    return {"load_totals": reports[0].totals, "losses": losses, "updates": updates}


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
    case = FlashRunCase(flash_recipe, str(out))
    results = run_ranks(rank_flash_lora_recipe, case, nproc=flash_recipe.world_size, timeout_s=TIMEOUT_S,
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


def test_flash_recipe_adapter_passes_verify_adapter_cli(flash_run, flash_recipe):
    case, _ = flash_run
    if launched_world().rank != 0:
        pytest.skip("rank 0 checks the published adapter")
    adapter = Path(case.out)
    assert (adapter / ".complete").exists(), f"export did not publish {adapter}"
    cli = [sys.executable, "-m", "impl.cli", "verify-adapter", "--base", flash_recipe.checkpoint, "--adapter", adapter]
    result = run([str(a) for a in cli], timeout=1800)
    assert result.returncode == 0, (
        f"verify-adapter failed on {adapter}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
