"""A native LoRA model with non-zero adapters on all five attention targets computes exactly what transformers'
DeepseekV4ForCausalLM computes with ``W + (alpha/r) * B @ A`` merged into those five weights.

The native model is built the canonical Megatron-Bridge way (provider with pre-wrap hooks [load the official base,
then LoRA], DDP) and trained for a few steps, so every lora_B is non-zero. The merge is done by hand from the
adapter gathered out of the ranks (at TP=2: from both ranks' shards), independently of PEFT. The runs are shared
with ``test_adapter_roundtrip.py`` (same xdist group), which checks the exported files against real PEFT."""

import numpy as np
import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.e2e_rank_fns import FIVE_TARGETS, case_ids, merged_oracle, oracle_logits, run_e2e, trained_case
from tiny_models.oracle import load_oracle
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-e2e")]

PRESET = "tiny-tp"
BASE_SEED = 5
#: Units of eps(float32) * max|merged oracle logits|, qualify's float32 figure: the native LoRA forward (sharded,
#: adapters unmerged) and the merged oracle are two fp32 forwards of one function, and the merge rounds
#: ``W + s B@A`` once per target weight, so they differ by rounding relative to the logits' scale.
LOGIT_ULPS = 256


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_lora_logits_equal_oracle_with_merged_five_target_adapter(impl, tiny_ckpt_factory, layout):
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case, nproc = trained_case(impl.name, ckpt, layout, seq=min_seq_len(get_preset(PRESET)))
    results = run_e2e(case, nproc=nproc)
    adapter = results[0].payload["adapter"]
    assert adapter["targets"] == list(FIVE_TARGETS), f"{layout}: gathered targets {adapter['targets']}"
    zero_b = [n for n, t in adapter["tensors"].items() if "linear_out" in n and not np.any(t)]
    assert not zero_b, f"{layout}: lora_B is all zero for {zero_b}; training did not reach the adapters"

    ids = case_ids(case, get_preset(PRESET).vocab_size)
    want = oracle_logits(merged_oracle(ckpt, adapter), ids)
    base = oracle_logits(load_oracle(ckpt), ids)
    effect = ah.max_abs(want - base)
    # the smallest effect claimed is one target in one layer, about the whole effect shared over those pairs
    pairs = len(FIVE_TARGETS) * get_preset(PRESET).num_hidden_layers
    tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=ah.max_abs(want))
    ah.assert_effect_exceeds(
        effect, tolerance, factor=pairs, what="the merged adapter per (target, layer)", context=layout
    )
    for r in results:
        ah.assert_close_ulps(
            torch.from_numpy(r.payload["logits"]),
            want,
            dtype=torch.float32,
            ulps=LOGIT_ULPS,
            name="native LoRA logits vs the merged oracle",
            context=f"{layout} rank {r.rank}, adapter effect {effect:.2e}",
        )
