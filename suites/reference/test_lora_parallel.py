"""LoRA shards follow their base module's parallel semantics, and training under TP / EP touches only adapters.

Megatron-Bridge builds every adapter half as a Megatron parallel linear. The property that matters: the half that
meets the base's split dimension is split the same way (column-parallel base -> lora_B rows = the base's local
rows; row-parallel base -> lora_A columns = the base's local columns), and the full adapter is the concatenation
along ``partition_dim``. Under EP the attention adapters are data-parallel replicas and must stay identical."""

import math

import numpy as np
import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.e2e_rank_fns import ClipCase, rank_clipped_sgd_step, run_e2e, trained_case
from fixtures.runner.multirank import impl_preload, run_ranks
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-e2e")]

PRESET = "tiny-tp"
BASE_SEED = 5  # the same run as suites/reference/test_adapter_roundtrip.py (shared within one process)
R = 4
COLUMN, ROW, REPLICATED = ("wq_b", "wo_a"), ("wo_b",), ("wq_a", "wkv")
#: units of eps(float32) * the clip bound for the clipped update's norm: the fp32 sums of squares behind the norm
#: (a few units), the 1e-6 clip_grad_norm adds to the norm (a unit or so at this model's gradient norm), and an
#: update that is exact (it lands on lora_B's zeros; lora_A's gradient is zero while B is); 32 leaves room
CLIP_ULPS = 32
#: clipping each rank by its own norm must move the update's norm this many tolerances
EFFECT_FACTOR = 10


def _results(impl, tiny_ckpt_factory, layout):
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case, nproc = trained_case(impl.name, ckpt, layout, seq=min_seq_len(get_preset(PRESET)))
    return run_e2e(case, nproc=nproc)


def test_tp2_adapter_shards_follow_their_base_split(impl, tiny_ckpt_factory):
    results = _results(impl, tiny_ckpt_factory, "tp2")
    for res in results:
        shards = res.payload["shards"]
        assert len(shards) == 5 * get_preset(PRESET).num_hidden_layers, f"rank {res.rank}: {sorted(shards)}"
        for name, s in shards.items():
            leaf = name.rsplit(".", 1)[1]
            (b_shape, b_tp, b_dim), (a_shape, a_tp, a_dim), (lb_shape, lb_tp, lb_dim) = s["base"], s["A"], s["B"]
            where = f"rank {res.rank} {name}"
            assert a_tp and lb_tp, f"{where}: adapter halves must be tensor-parallel (A {a_tp}, B {lb_tp})"
            assert lb_dim == 0 and lb_shape[1] == R, f"{where}: lora_B {lb_shape} split dim {lb_dim}"
            if leaf in COLUMN:
                assert b_tp and b_dim == 0, f"{where}: base should be column-parallel, got tp={b_tp} dim={b_dim}"
                assert lb_shape[0] == b_shape[0], f"{where}: lora_B rows {lb_shape} != base local rows {b_shape}"
                assert a_dim == 0 and a_shape == (R // 2, b_shape[1]), f"{where}: lora_A {a_shape} dim {a_dim}"
            elif leaf in ROW:
                assert b_tp and b_dim == 1, f"{where}: base should be row-parallel, got tp={b_tp} dim={b_dim}"
                assert a_dim == 1 and a_shape == (R, b_shape[1]), f"{where}: lora_A {a_shape} vs base {b_shape}"
                assert lb_shape[0] * 2 == b_shape[0], f"{where}: lora_B {lb_shape} vs base {b_shape}"
            else:
                assert leaf in REPLICATED and not b_tp, f"{where}: base should be replicated, got tp={b_tp}"
                assert a_dim == 0 and a_shape == (R // 2, b_shape[1]), f"{where}: lora_A {a_shape} dim {a_dim}"
                assert lb_shape[0] * 2 == b_shape[0], f"{where}: lora_B {lb_shape} vs base {b_shape}"


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_adam_steps_update_every_adapter_and_leave_the_base_bit_identical(impl, tiny_ckpt_factory, layout):
    results = _results(impl, tiny_ckpt_factory, layout)
    for res in results:
        p = res.payload
        assert not p["base_changed"], f"{layout} rank {res.rank}: base params changed by training: {p['base_changed']}"
        updates = p["adapter_update"]
        assert len(updates) == 2 * 5 * get_preset(PRESET).num_hidden_layers, f"{layout} rank {res.rank}: {updates}"
        for name, (delta, finite) in updates.items():
            assert finite and delta > 0, f"{layout} rank {res.rank}: {name} update max|Δ|={delta} finite={finite}"
    if layout == "ep2":  # the attention adapters are data-parallel replicas across the EP ranks
        a, b = (r.payload["adapter_final"] for r in results)
        diverged = [n for n in a if not np.array_equal(a[n], b[n])]
        assert not diverged, f"ep2: rank 0 and rank 1 hold different adapters after training: {diverged[:4]}"


def test_gradient_clipping_bounds_the_norm_of_the_whole_tp_sharded_update(impl, tiny_ckpt_factory):
    """With SGD at lr 1 the update is the clipped gradient: its norm over the whole model (every TP shard once,
    a tensor every TP rank holds counted once) equals the bound when the gradient is larger. Clipping each rank
    by its own shard's norm would give sqrt(2) times the bound here."""
    clip = 1e-4
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case = ClipCase(impl_name=impl.name, ckpt_dir=ckpt, tp=2, clip_grad=clip, seq=min_seq_len(get_preset(PRESET)))
    results = run_ranks(rank_clipped_sgd_step, case, nproc=2, timeout_s=150, preload=impl_preload(impl.name))
    counted = [(sq, r.rank) for r in results for sq, sharded in r.payload.values() if sharded or r.rank == 0]
    per_rank = [math.sqrt(sum(sq for sq, _ in r.payload.values())) for r in results]
    norm = math.sqrt(sum(sq for sq, _ in counted))
    tolerance = ah.ulp_tolerance(torch.float32, ulps=CLIP_ULPS, scale=clip)
    # clipping each rank by its own norm would scale rank r's update to per_rank[r] = clip
    per_rank_clipped = math.sqrt(sum(sq * (clip / per_rank[rank]) ** 2 for sq, rank in counted))
    ah.assert_effect_exceeds(
        abs(per_rank_clipped - clip), tolerance, factor=EFFECT_FACTOR, what="clipping each rank by its own norm"
    )
    ah.assert_within_ulps(
        abs(norm - clip),
        dtype=torch.float32,
        ulps=CLIP_ULPS,
        scale=clip,
        what=f"the clipped update's global norm {norm:.6e} vs the bound {clip:g}",
        context=f"per-rank norms {per_rank}",
    )
