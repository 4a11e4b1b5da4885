"""A native LoRA model with non-zero adapters on all five attention targets computes exactly what transformers'
DeepseekV4ForCausalLM computes with ``W + (alpha/r) * B @ A`` merged into those five weights (issue 5).

The native model is built the canonical Megatron-Bridge way: provider with pre-wrap hooks [load the official base,
then LoRA]; every lora_A/lora_B is then overwritten with random values, so the adapter path is really exercised.
At TP=2 the merged delta is computed from the adapter gathered out of the two ranks' shards."""

import numpy as np
import pytest
import torch

from fixtures.e2e_rank_fns import FIVE_TARGETS, LoraE2ECase, case_ids, merged_oracle, oracle_logits, rank_lora_e2e
from fixtures.multirank import IMPL_PRELOAD, run_ranks
from tiny_models.checkpoint import load_oracle
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

PRESET = "tiny-tp"
LOGIT_TOL = 1e-5
MIN_ADAPTER_EFFECT = 1e-3  # the adapters must move the logits far more than the tolerance, or the test proves nothing


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_logits_equal_oracle_with_merged_five_target_adapter(impl, tiny_ckpt_factory, tp):
    ckpt = tiny_ckpt_factory(PRESET, seed=5)
    case = LoraE2ECase(impl.name, str(ckpt), tp=tp, seq=min_seq_len(get_preset(PRESET)), randomize_seed=11)
    results = run_ranks(rank_lora_e2e, case, nproc=tp, timeout_s=120, preload=IMPL_PRELOAD)
    adapter = results[0].payload["adapter"]
    assert adapter["targets"] == list(FIVE_TARGETS), f"tp={tp}: gathered targets {adapter['targets']}"
    nonzero = [n for n, t in adapter["tensors"].items() if "linear_out" in n and not np.any(t)]
    assert not nonzero, f"tp={tp}: lora_B is all zero for {nonzero}; the adapters were not randomized"

    ids = case_ids(case, get_preset(PRESET).vocab_size)
    want = oracle_logits(merged_oracle(str(ckpt), adapter), ids)
    base = oracle_logits(load_oracle(str(ckpt)), ids)
    effect = (want - base).abs().max().item()
    assert effect > MIN_ADAPTER_EFFECT, f"tp={tp}: the merged adapter moves the oracle logits by only {effect:.2e}"
    for r in results:
        got = torch.from_numpy(r.payload["logits"])
        assert got.shape == want.shape, f"tp={tp} rank {r.rank}: logits {tuple(got.shape)} vs {tuple(want.shape)}"
        diff = (got - want).abs().max().item()
        assert diff <= LOGIT_TOL, (
            f"tp={tp} rank {r.rank}: native LoRA logits differ from the merged oracle by max|Δ|={diff:.3e} > "
            f"{LOGIT_TOL} (adapter effect {effect:.2e})"
        )
    print(
        f"tp={tp}: max|Δ| vs merged oracle = {max((torch.from_numpy(r.payload['logits']) - want).abs().max().item() for r in results):.3e}, adapter effect {effect:.2e}"
    )
