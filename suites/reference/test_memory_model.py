"""The memory model of the LoRA recipes (``impl.recipe_memory``): what each rank holds, and that it fits.

* Weights: every pipeline stage is built on the meta device; summed over stages (routed experts times EP) the
  bytes equal the official manifest's (tiny_models, an independent table) in bf16, so nothing is lost or counted
  twice.
* Activations: the analytic model agrees with the bytes autograd really keeps (saved-tensor hooks) on tiny models
  with LoRA on the five attention projections, in fp32 and bf16, eager and query-block attention, with and without
  selective recompute, within ``ACTIVATION_RTOL``.
* The Flash recipe (TP1 PP4 EP8, 32 ranks) and the Pro recipe fit: the heaviest rank <= ``BUDGET_GB``; the tables in
  ``recipes/deepseek_v4_flash_lora.md`` are the ones computed here.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.asserts.saved_tensors import param_storages, saved_bytes
from fixtures.data.native_weights import ensure_single_rank_megatron
from fixtures.runner.subproc import REPO_ROOT
from tiny_models.manifest import manifest
from tiny_models.presets import flash_config, get_preset, min_seq_len, pro_config

pytestmark = pytest.mark.cpu

BUDGET_GB = 70.0
ACTIVATION_RTOL = 0.06  # measured within 5 % (the first CSA layer of a stage, fp32, is the worst)
DOC = REPO_ROOT / "recipes" / "deepseek_v4_flash_lora.md"
TARGETS = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]
PLANS = {
    "no-recompute": {},
    "selective-mhc-moe-act": dict(recompute_granularity="selective", recompute_modules=("mhc", "moe_act")),
    "selective-core-attn": dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
}


#: the recipe rows build each stage's native graph with its LoRA (seconds for Pro): one worker builds them once
ROWS_GROUP = pytest.mark.xdist_group("memory-model-rows")


@pytest.fixture(scope="module")
def flash_rows(impl):
    ensure_single_rank_megatron(impl)  # Megatron-Bridge 0.4's LoRA asks parallel state for the TP size
    return impl.recipe_memory(flash_config(), impl.deepseek_v4_flash_lora_recipe())


@pytest.fixture(scope="module")
def pro_rows(impl):
    ensure_single_rank_megatron(impl)
    return impl.recipe_memory(pro_config(), impl.deepseek_v4_pro_lora_recipe())


def _measure_and_model(impl, hf, dtype: torch.dtype, plan: dict, lora_rank: int = 4) -> tuple[int, int]:
    """(bytes autograd keeps, bytes the model predicts) for the whole tiny model, micro-batch 2."""
    ensure_single_rank_megatron(impl)
    cfg = impl.V4Config.from_hf(hf)
    seq, batch = 2 * min_seq_len(hf), 2
    torch.manual_seed(0)
    model = impl.DeepseekV4NativeModel(cfg, params_dtype=dtype, activations=impl.ActivationPlan(**plan))
    impl.apply_lora(model, targets=TARGETS, rank=lora_rank, alpha=8.0)
    ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    _, measured = saved_bytes(lambda: model(ids, labels=torch.roll(ids, -1, dims=1)).mean(), param_storages(model))
    shape = impl.ActivationShape(
        micro_batch=batch, seq_len=seq, dtype_bytes=dtype.itemsize, lora_rank=lora_rank, **plan
    )
    modeled, transient = impl.stage_activation_bytes(cfg, list(range(cfg.num_layers)), shape, first=True, head=True)
    assert transient == 0
    return measured, modeled


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("attention", ["eager", "query-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["tiny-mixed", "tiny-tp"])
def test_activation_model_matches_measured_saved_tensors(impl, preset, dtype, attention, plan):
    chunking = dict(attention_chunk_threshold=0 if attention == "query-blocks" else 10**9, attention_query_block=16)
    measured, modeled = _measure_and_model(impl, get_preset(preset), dtype, {**PLANS[plan], **chunking})
    assert abs(modeled - measured) <= ACTIVATION_RTOL * measured, (
        f"{preset} {dtype} {attention} {plan}: model {modeled} bytes vs measured {measured} "
        f"({modeled / measured - 1:+.1%})"
    )


#: One knob per term of the model that is small next to the whole (a dropped routed-expert or adapter term moves
#: the total by less than ``ACTIVATION_RTOL``): doubling it must move the model as much as the measurement.
TERM_KNOBS = {
    "routed experts (top-k 1 -> 2)": ("num_experts_per_tok", 1, 2),
    "shared experts (1 -> 2)": ("n_shared_experts", 1, 2),
    "LoRA activations (rank 4 -> 16)": ("lora_rank", 4, 16),
}
TERM_RTOL = 0.05


@pytest.mark.parametrize("term", sorted(TERM_KNOBS))
def test_each_small_term_of_the_activation_model_moves_with_the_measurement(impl, term):
    field, low, high = TERM_KNOBS[term]
    deltas = []
    for value in (low, high):
        hf = get_preset("tiny-mixed")
        if field == "lora_rank":
            deltas.append(_measure_and_model(impl, hf, torch.float32, PLANS["no-recompute"], lora_rank=value))
        else:
            setattr(hf, field, value)
            deltas.append(_measure_and_model(impl, hf, torch.float32, PLANS["no-recompute"]))
    measured = deltas[1][0] - deltas[0][0]
    modeled = deltas[1][1] - deltas[0][1]
    assert measured > 0, f"{term}: the measurement did not move ({deltas})"
    assert abs(modeled - measured) <= TERM_RTOL * measured, (
        f"{term}: the model moves by {modeled} bytes, autograd keeps {measured} more ({modeled / measured - 1:+.1%})"
    )


def _manifest_bytes(cfg) -> int:
    sizes = {"F32": 4, "BF16": 2, "I64": 8}
    return sum(torch.Size(s.shape).numel() * sizes[s.dtype] for s in manifest(cfg, dtype=torch.bfloat16))


@ROWS_GROUP
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_stage_weights_add_up_to_the_checkpoint_manifest(impl, model, request):
    rows = request.getfixturevalue(f"{model}_rows")
    recipe = impl.deepseek_v4_flash_lora_recipe() if model == "flash" else impl.deepseek_v4_pro_lora_recipe()
    cfg = flash_config() if model == "flash" else pro_config()
    # a row is one rank: scale its routed experts back to all EP ranks and its TP-split tensors to all TP ranks;
    # a stage with MTP but no embedding holds its own copy of the (TP-split) embedding, the checkpoint one
    total = sum(
        r.base + r.notes["expert_bytes"] * (recipe.ep - 1) + r.notes["tp_split_bytes"] * (recipe.tp - 1) for r in rows
    )
    embedding = cfg.vocab_size * cfg.hidden_size * 2
    total -= embedding * sum(1 for r in rows if "mtp" in r.tokens and "embedding" not in r.tokens)
    want = _manifest_bytes(cfg)
    assert total == want, f"{model}: stages hold {total} bytes of weights, the bf16 manifest {want}"


@ROWS_GROUP
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_heaviest_rank_of_the_recipe_fits_the_budget(impl, model, request):
    rows = request.getfixturevalue(f"{model}_rows")
    heaviest = max(rows, key=lambda r: r.total)
    assert heaviest.total / 1e9 <= BUDGET_GB, (
        f"{model}: stage {heaviest.stage} needs {heaviest.total / 1e9:.1f} GB > {BUDGET_GB} GB:\n"
        + impl.format_memory_table(rows)
    )
    # the recompute is what makes it fit: without it stage 0 holds several micro-batches of full activations
    assert rows[0].total_no_recompute / 1e9 > BUDGET_GB, impl.format_memory_table(rows)


@ROWS_GROUP
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_recipe_doc_carries_the_computed_memory_table(impl, model, request):
    table = impl.format_memory_table(request.getfixturevalue(f"{model}_rows"))
    assert table in DOC.read_text(), (
        f"recipes/deepseek_v4_flash_lora.md does not hold the current {model} memory table; replace it with:\n{table}"
    )
