"""The distributed properties of the CPU suites, again under NCCL on one 8-GPU node.

Run as ranks (every pytest process is one rank; ``run_ranks`` then runs in-process on NCCL)::

    torchrun --nproc-per-node 8 -m pytest -p no:cacheprovider -m gpu suites/reference/test_gpu.py --nproc 8 -rs

(``DSV4_RUN=gpu NNODES=1 recipes/launch_torchrun.sh`` does the same; plain ``pytest -m gpu --nproc 8`` spawns 8
NCCL ranks instead, never gloo ones.) Layouts that do not factor ``--nproc`` are skipped with the reason. Without
CUDA, conftest skips every test here, except in the CPU rehearsal (gloo, CPU; ``.ci/run``)::

    torchrun --standalone --nproc-per-node 4 -m pytest -m gpu --rehearse suites/reference/test_gpu*.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.bridge_rank_fns import RoundTripCase, rank_bridge_roundtrip
from fixtures.ranks.e2e_rank_fns import FIVE_TARGETS, LoraE2ECase, case_ids, merged_oracle, oracle_logits, rank_lora_e2e
from fixtures.runner.multirank import destroy_megatron_parallel, impl_preload, launched_world, run_ranks
from tiny_models.oracle import load_oracle
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.gpu, pytest.mark.multirank]

PRESET = "tiny-tp"  # heads 8, o_groups 4, experts 8, vocab 128: every split below is even
BASE_SEED = 5
#: Logit tolerance in units of eps(float32) * max|oracle logits|: GPU kernels reduce in another order than the CPU
#: oracle, so the two fp32 forwards differ by rounding, relative to the logits' scale; the same figure as qualify's
#: float32 check, which compares the same two forwards. (TF32 would be a different dtype, not more units.)
LOGIT_ULPS = 256
TIMEOUT_S = 600
LAYOUTS: dict[str, dict[str, int]] = {
    "tp2-ep4": {"tp": 2, "ep": 4},  # also fits 4 ranks (DP 2): a 4-GPU node, and the CPU rehearsal (.ci/run)
    "ep8": {"ep": 8},
    "tp4-pp2": {"tp": 4, "pp": 2},
    "pp2-ep4": {"pp": 2, "ep": 4},
}


def _fits(layout: dict[str, int], nproc: int) -> bool:
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    return nproc % (tp * pp) == 0 and nproc % (pp * ep) == 0


@pytest.fixture
def layout(request, nproc):
    spec = LAYOUTS[request.param]
    if not _fits(spec, nproc):
        pytest.skip(f"layout {request.param} {spec} does not factor --nproc {nproc}")
    yield request.param, spec
    if launched_world() is not None:  # in-process ranks: the next test builds its own groups
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from tiny_models.oracle import write_checkpoint

    # Deterministic (seeded), so every rank's private copy holds the same bytes.
    return str(write_checkpoint(PRESET, tmp_path_factory.mktemp("gpu-ckpt"), seed=BASE_SEED))


@pytest.mark.parametrize("layout", sorted(LAYOUTS), indirect=True)
def test_load_then_export_is_bit_exact_and_logits_match_oracle_under_nccl(impl, ckpt, layout, nproc):
    name, spec = layout
    seq = min_seq_len(get_preset(PRESET)) if spec.get("pp", 1) == 1 else 0  # the bridge rank fn has no pipeline
    case = RoundTripCase(impl_name=impl.name, ckpt_dir=ckpt, logits_seq=seq, **spec)
    results = run_ranks(rank_bridge_roundtrip, case, nproc=nproc, timeout_s=TIMEOUT_S, preload=impl_preload(impl.name))
    for r in results:
        p = r.payload
        assert not p["mismatches"], f"{name} rank {r.rank}: not bit-exact:\n  " + "\n  ".join(p["mismatches"][:40])
        assert p["totals"]["unmapped"] == 0 and p["totals"]["missing"] == 0, f"{name} rank {r.rank}: {p['totals']}"
        if seq:
            tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=p["logit_scale"])
            assert p["logit_diff"] <= tolerance, (
                f"{name} rank {r.rank}: logits {p['logits_shape']} differ from the transformers oracle by "
                f"max|Δ|={p['logit_diff']:.3e} > {tolerance:.3e} ({LOGIT_ULPS} units of eps(float32) * "
                f"max|logits| {p['logit_scale']:.4g})"
            )


@pytest.mark.parametrize("layout", sorted(LAYOUTS), indirect=True)
def test_trained_lora_logits_equal_merged_oracle_under_nccl(impl, ckpt, layout, nproc):
    name, spec = layout
    case = LoraE2ECase(
        impl_name=impl.name,
        ckpt_dir=ckpt,
        seq=min_seq_len(get_preset(PRESET)),
        train_steps=3,
        lr=1e-2,
        wrap_with_ddp=True,
        **spec,
    )
    results = run_ranks(rank_lora_e2e, case, nproc=nproc, timeout_s=TIMEOUT_S, preload=impl_preload(impl.name))
    adapter = results[0].payload["adapter"]
    assert adapter["targets"] == list(FIVE_TARGETS), f"{name}: gathered targets {adapter['targets']}"
    zero_b = [n for n, t in adapter["tensors"].items() if "linear_out" in n and not np.any(t)]
    assert not zero_b, f"{name}: lora_B is all zero for {zero_b}; training did not reach the adapters"
    for r in results:
        p = r.payload
        assert not p["base_changed"], f"{name} rank {r.rank}: training changed base tensors {p['base_changed'][:10]}"
        bad = [n for n, (delta, finite) in p["adapter_update"].items() if not finite or delta == 0.0]
        assert not bad, f"{name} rank {r.rank}: adapters not updated or not finite: {bad[:10]}"
    ids = case_ids(case, get_preset(PRESET).vocab_size)
    want = oracle_logits(merged_oracle(ckpt, adapter), ids)
    effect = ah.max_abs(want - oracle_logits(load_oracle(ckpt), ids))
    # the smallest effect claimed is one target in one layer, about the whole effect shared over those pairs
    pairs = len(FIVE_TARGETS) * get_preset(PRESET).num_hidden_layers
    tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=ah.max_abs(want))
    ah.assert_effect_exceeds(
        effect, tolerance, factor=pairs, what="the merged adapter per (target, layer)", context=name
    )
    with_logits = [r for r in results if "logits" in r.payload]
    assert with_logits, f"{name}: no rank returned logits (last pipeline stage missing?)"
    for r in with_logits:
        got = torch.from_numpy(r.payload["logits"])
        ah.assert_close_ulps(
            got,
            want,
            dtype=torch.float32,
            ulps=LOGIT_ULPS,
            name="LoRA logits vs the merged oracle",
            context=f"{name} rank {r.rank}",
        )
