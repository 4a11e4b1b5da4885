"""A native LoRA model with non-zero adapters on all five attention targets computes exactly what transformers'
DeepseekV4ForCausalLM computes with ``W + (alpha/r) * B @ A`` merged into those five weights (issue 5).

The native model is built the canonical Megatron-Bridge way (provider with pre-wrap hooks [load the official base,
then LoRA], DDP) and trained for a few steps, so every lora_B is non-zero. The merge is done by hand from the
adapter gathered out of the ranks (at TP=2: from both ranks' shards), independently of PEFT. The runs are shared
with ``test_adapter_roundtrip.py`` (same xdist group), which checks the exported files against real PEFT."""

import numpy as np
import pytest
import torch

import fixtures.asserts as ah
from fixtures.e2e_rank_fns import FIVE_TARGETS, case_ids, merged_oracle, oracle_logits, run_e2e, trained_case
from tiny_models.checkpoint import load_oracle
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-e2e")]

PRESET = "tiny-tp"
BASE_SEED = 5
LOGIT_TOL = 1e-5
MIN_ADAPTER_EFFECT = 1e-3  # the adapters must move the logits far more than the tolerance, or the test proves nothing


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
    effect = (want - base).abs().max().item()
    assert effect > MIN_ADAPTER_EFFECT, f"{layout}: the merged adapter moves the oracle logits by only {effect:.2e}"
    for r in results:
        ah.assert_close(
            torch.from_numpy(r.payload["logits"]),
            want,
            atol=LOGIT_TOL,
            name="native LoRA logits vs the merged oracle",
            context=f"{layout} rank {r.rank}, adapter effect {effect:.2e}",
        )
