"""bf16, the recipe's dtype: parameters in bf16, fp32 adapter masters and gradients, stated tolerances.

Built through the provider with ``params_dtype=torch.bfloat16`` from an fp32 checkpoint: the weights and LoRA
adapters are bf16; the tensors the checkpoint keeps in fp32 (``attn_sink``, ``ape``, ``hc_*``) stay fp32; DDP
reduces into fp32 ``main_grad``; ``impl.AdapterOptimizer`` steps fp32 masters and writes them back (Megatron's
``Float16OptimizerWithFloat16Params`` scheme).

Tolerances against the fp32 transformers oracle (tiny-mixed, 2 x 48 tokens), in units of eps(bfloat16) *
max|oracle logits| and relative to what transformers itself gets in bf16 on the same checkpoint, measured in the
same run (routing and indexer top-k flip under bf16 rounding, so a few tokens move far in either implementation;
measured: native mean|Δ| 1.5 units, transformers-bf16 1.2; median per-token max|Δ| 3.1 and 2.9 units):

* mean |logit error| <= ``MEAN_ABS_ULPS`` units and <= ``RATIO_TOL`` x transformers-bf16's mean |logit error|;
* median over tokens of the max |logit error| <= ``RATIO_TOL`` x transformers-bf16's same figure;
* each of 3 training losses within ``LOSS_ULPS`` units of eps(bfloat16) * the fp32 run's loss (measured <= 2.6).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fixtures.asserts as ah
from fixtures.runner.multirank import impl_preload, run_ranks
from fixtures.runner.qualify_runs import GROUP as QUALIFY_GROUP
from tiny_models.oracle import load_oracle, write_checkpoint
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

PRESET = "tiny-mixed"
TARGETS = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]
QUALIFY_BF16_ULPS = 4  # qualify's bf16 tolerance: 4 * eps(bf16) * max|reference logits| (docs/commands.md, qualify)
#: units of eps(bfloat16) * max|oracle logits| for the mean |logit error|: the figure qualify holds its bf16
#: base_logits check to (the same mean |Δ| against the same fp32 oracle); the ratio below is the sharper bound
MEAN_ABS_ULPS = QUALIFY_BF16_ULPS
#: native bf16 against transformers' own bf16 error on the same checkpoint (both round the same weights and flip
#: the same kind of routing choices, at different points of the graph): at most twice as far
RATIO_TOL = 2.0
#: units of eps(bfloat16) * |fp32 loss| per training step: one bf16 forward moves each token's loss by at most
#: 2 max|Δ logit| (a few units, the per-token figure), and each step's bf16 adapters round the update once more
#: (lr 1e-2 moves a tiny model far per step); 8 leaves room
LOSS_ULPS = 8
#: units of eps(float32) * max|oracle logits| for the fp32 reference run (test_native_oracle_property's analysis)
FP32_LOGIT_ULPS = 128
#: units of eps(float64) * the figure for a tolerance qualify reports against the same formula recomputed here
#: from its reported scale: the same float64 products (ulps * eps * scale), a rounding or two if associated apart
REPORTED_ULPS = 4
FP32_FAMILIES = ("attn_sink", "compressor.ape", "hc_", "expert_bias")


@dataclass(frozen=True)
class Bf16Case:
    impl_name: str
    ckpt: str
    steps: int = 3


def _ids(vocab: int) -> torch.Tensor:
    cfg = get_preset(PRESET)
    return torch.randint(0, vocab, (2, min_seq_len(cfg)), generator=torch.Generator().manual_seed(0))


def _train_one(api, case: Bf16Case, dtype: torch.dtype) -> dict:
    cfg = get_preset(PRESET)
    hook = api.make_lora_pre_wrap_hook(targets=TARGETS, rank=4, alpha=8.0)

    def load(chunks):
        api.load_official_checkpoint(chunks, case.ckpt)
        return chunks

    chunks = api.build_native_model(cfg, pre_wrap_hooks=[load, hook], wrap_with_ddp=True, params_dtype=dtype)
    (chunk,) = chunks
    ids = _ids(cfg.vocab_size).to(api.rank_device())
    chunk.eval()
    with torch.no_grad():
        base_logits = chunk(ids).float().cpu().numpy()
    opt = api.AdapterOptimizer(chunks, lr=1e-2, clip_grad=1.0)
    chunk.train()
    losses = []
    for step in range(case.steps):
        batch = torch.roll(ids, step, dims=1)
        opt.zero_grad()
        chunk.zero_grad_buffer()
        loss = chunk(batch, labels=torch.roll(batch, -1, dims=1)).mean()
        loss.backward()
        chunk.finish_grad_sync()
        opt.step()
        losses.append(float(loss))
    model = chunk.module
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    masters = opt.fp32_from_float16_groups[0]
    return {
        "base_logits": base_logits,
        "losses": losses,
        "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
        "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in adapters.values()}),
        "master_dtypes": sorted({str(m.dtype) for m in masters}),
        "n_masters": len(masters),
        "params_equal_masters": all(
            torch.equal(p.detach(), m.to(p.dtype)) for p, m in zip(opt.params, opt.masters, strict=True)
        ),
    }


def rank_bf16_vs_fp32(rank: int, world_size: int, case: Bf16Case) -> dict:
    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel

    api = load_impl(case.impl_name)
    init_megatron_parallel()
    return {"fp32": _train_one(api, case, torch.float32), "bf16": _train_one(api, case, torch.bfloat16)}


#: the tests of the one fp32/bf16 training run: one worker trains it once
RUNS_GROUP = pytest.mark.xdist_group("bf16-runs")


@pytest.fixture(scope="module")
def runs(impl, tmp_path_factory):
    ckpt = str(write_checkpoint(PRESET, tmp_path_factory.mktemp("bf16-ckpt"), seed=3))
    (result,) = run_ranks(
        rank_bf16_vs_fp32, Bf16Case(impl.name, ckpt), nproc=1, timeout_s=600, preload=impl_preload(impl.name)
    )
    ids = _ids(get_preset(PRESET).vocab_size)
    with torch.no_grad():
        oracle = load_oracle(ckpt)(ids).logits.float().numpy()
        oracle_bf16 = load_oracle(ckpt).to(torch.bfloat16)(ids).logits.float().numpy()
    return result.payload, oracle, oracle_bf16


@RUNS_GROUP
def test_bf16_build_keeps_weights_and_adapters_in_bf16_and_the_fp32_families_in_fp32(runs):
    payload, _, _ = runs
    dtypes = payload["bf16"]["dtypes"]
    fp32_expected = {n for n in dtypes if any(f in n for f in FP32_FAMILIES)}
    wrong = {n: d for n, d in dtypes.items() if d != ("torch.float32" if n in fp32_expected else "torch.bfloat16")}
    assert not wrong, f"bf16 build: unexpected parameter dtypes {dict(list(wrong.items())[:12])}"
    assert any(".adapter." in n for n in dtypes), "no LoRA adapters in the bf16 build"


@RUNS_GROUP
def test_bf16_adapters_train_through_fp32_gradients_and_fp32_masters(runs):
    payload, _, _ = runs
    run = payload["bf16"]
    assert run["main_grad_dtypes"] == ["torch.float32"], f"DDP main_grad dtypes {run['main_grad_dtypes']}"
    assert run["n_masters"] > 0 and run["master_dtypes"] == ["torch.float32"], run["master_dtypes"]
    assert run["params_equal_masters"], "after a step the bf16 adapters are not the bf16 cast of their fp32 masters"
    assert payload["fp32"]["n_masters"] == 0, "fp32 parameters need no separate master copy"


@RUNS_GROUP
def test_bf16_logits_agree_with_the_fp32_oracle_within_the_stated_tolerances(runs):
    payload, oracle, oracle_bf16 = runs
    ah.assert_close_ulps(
        payload["fp32"]["base_logits"],
        oracle,
        dtype=torch.float32,
        ulps=FP32_LOGIT_ULPS,
        name="fp32 native vs fp32 oracle logits (the reference run itself)",
    )
    err = np.abs(payload["bf16"]["base_logits"] - oracle)
    ref_err = np.abs(oracle_bf16 - oracle)
    reference, ref_median_token = ref_err.mean(), float(np.median(ref_err.max(-1)))
    mean, median_token = err.mean(), float(np.median(err.max(-1)))
    ah.assert_within_ulps(
        float(mean), dtype=torch.bfloat16, ulps=MEAN_ABS_ULPS, scale=ah.max_abs(oracle), what="bf16 mean|Δ|"
    )
    assert mean <= RATIO_TOL * reference, f"bf16 mean|Δ| {mean:.4f} > {RATIO_TOL} x transformers-bf16 {reference:.4f}"
    assert median_token <= RATIO_TOL * ref_median_token, (
        f"median per-token max|Δ| {median_token:.4f} > {RATIO_TOL} x transformers-bf16's {ref_median_token:.4f}"
    )


@RUNS_GROUP
def test_bf16_training_losses_track_the_fp32_run(runs):
    payload, _, _ = runs
    fp32, bf16 = payload["fp32"]["losses"], payload["bf16"]["losses"]
    for step, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        ah.assert_within_ulps(
            abs(b - a),
            dtype=torch.bfloat16,
            ulps=LOSS_ULPS,
            scale=abs(a),
            what=f"bf16 loss {b:.4f} vs fp32 {a:.4f}",
            context=f"step {step}",
        )
    assert bf16[-1] < bf16[0], f"bf16 training did not lower the loss: {bf16}"


@pytest.mark.slow
@pytest.mark.xdist_group(QUALIFY_GROUP)
def test_qualify_in_bf16_reloads_in_float32_where_one_lost_target_would_show(qualify_runs, tmp_path):
    """``dsv4-lora qualify --dtype bfloat16``: the base logits within the stated bf16 tolerance (mean |Δ|), and the
    bf16-trained adapter's reload compared in float32, where the float32 tolerance lies below the effect of every
    single target and layer (bf16 rounding alone moves the logits further than one target's delta)."""
    done = qualify_runs("--dtype", "bfloat16")  # the default preset is PRESET; shared with test_qualify_any_driver
    assert done.status == 0, f"qualify in bf16 failed:\n{done.printed[-6000:]}"
    assert done.report["options"]["preset"] == PRESET, done.report["options"]
    checks, out = done.checks(), done.out
    base = checks["base_logits"]
    assert base["passed"] is True and "mean|Δ|" in base["figure"], base
    mean_tol = ah.ulp_tolerance(torch.bfloat16, ulps=MEAN_ABS_ULPS, scale=base["detail"]["logit_scale"])
    assert base["detail"]["observed"] <= mean_tol, f"base_logits: mean|Δ| {base['detail']['observed']:.3f}"
    want_tol = QUALIFY_BF16_ULPS * torch.finfo(torch.bfloat16).eps * base["detail"]["logit_scale"]
    reported = ah.ulp_tolerance(torch.float64, ulps=REPORTED_ULPS, scale=want_tol)
    assert abs(base["detail"]["tolerance"] - want_tol) <= reported, f"base_logits: {base}, want {want_tol}"
    reload = checks["reload"]
    detail = reload["detail"]
    assert reload["passed"] is True and detail["compared"] == "a float32 build that imported the export", reload
    want_tol = 256 * torch.finfo(torch.float32).eps * detail["logit_scale"]
    reported = ah.ulp_tolerance(torch.float64, ulps=REPORTED_ULPS, scale=want_tol)
    assert abs(detail["tolerance"] - want_tol) <= reported, f"reload: tolerance {detail}, want {want_tol}"
    least, module = detail["least_effect"], detail["least_effect_of"]
    assert detail["observed"] <= detail["tolerance"] < least, f"reload cannot see {module} lost: {detail}"
    # the least module's effect again, with stock PEFT alone (its lora_B zeroed, merged onto the fp32 oracle)
    from fixtures.asserts.adapter_effects import part_effect

    found = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(\w+)", module)
    assert found, f"the least module {module} is no main-attention module"
    layer, leaf = int(found[1]), found[2]
    ids = torch.tensor(checks["train"]["detail"]["batch"])
    select = lambda n, lf: (n, lf) == (layer, leaf)  # noqa: E731
    measured = part_effect(out / "base", out / "adapter", ids, select, tmp_path / "without")
    assert measured > detail["tolerance"], f"{module}: stock PEFT effect {measured:.2e} <= tolerance"
