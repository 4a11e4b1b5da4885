"""Activation memory of the native graph: the query-block attention path and recompute change memory, not math.

* Above its length threshold the attention runs over query blocks (each sees its sliding-window band plus the
  compressed entries); in fp32 its output and gradients equal the eager path's within ``BLOCK_ULPS`` units of
  eps(float32) at the reference's scale (the largest gradient for gradients) on sliding, CSA (with
  the indexer choosing) and HCA layers, for blocks that do not divide the sequence and windows wider than a block.
* Recompute (Megatron's ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers`` /
  ``recompute_modules``) leaves the loss and every gradient unchanged and keeps strictly fewer bytes for backward
  (measured with autograd's saved-tensor hooks; parameters are not counted).
"""

from __future__ import annotations

import pytest
import torch

import fixtures.asserts as ah
from fixtures.asserts.saved_tensors import param_storages, saved_bytes
from fixtures.data.native_weights import ensure_single_rank_megatron
from tiny_models.presets import get_preset, min_seq_len

pytestmark = pytest.mark.cpu

#: units of eps(float32) * max|eager reference| (output, input gradient) or * the largest eager parameter gradient
#: (a backward rounds relative to the flows it sums): the block path only drops exact zeros from each softmax row,
#: so the two differ by summation order alone, a unit or two per reduction; 8 leaves room
BLOCK_ULPS = 8
#: units of eps(float32) * the largest gradient: recompute reruns the same forward, so only the order of the
#: backward's accumulations may change; 8 leaves room
RECOMPUTE_ULPS = 8
PRESET = "tiny-mixed"  # sliding/hash, CSA(4), HCA(16), CSA; window 8
RECOMPUTE_PLANS = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective-all": dict(recompute_granularity="selective", recompute_modules=("core_attn", "mhc", "moe_act")),
    "selective-core-attn": dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
}


@pytest.fixture(scope="module")
def megatron_world(impl) -> None:
    ensure_single_rank_megatron(impl)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is peaked (the default 0.02 init gives near-uniform softmax rows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2 and "hc_" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif p.dim() == 1 and not name.endswith("weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def _attention_pair(impl, layer: int, **plan):
    cfg = impl.V4Config.from_hf(get_preset(PRESET))
    eager = impl.DeepseekV4Attention(cfg, layer, activations=impl.ActivationPlan(attention_chunk_threshold=10**9))
    _randomize(eager, seed=layer)
    blocked = impl.DeepseekV4Attention(cfg, layer, activations=impl.ActivationPlan(**plan))
    blocked.load_state_dict(eager.state_dict())
    return cfg, eager, blocked


def _run_attention(module, x, positions):
    device = next(module.parameters()).device
    x = x.to(device).requires_grad_(True)
    out = module(x, positions.to(device))
    (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
    grads = {n: p.grad.cpu() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach().cpu(), x.grad.cpu(), grads


def _assert_gradients_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ulps: float, context: str
) -> None:
    """The same parameters have gradients, each within ``ulps`` units of eps(float32) at the scale of the largest one
    (the flow through the module)."""
    assert set(got) == set(want), f"{context}: gradients for {sorted(set(got) ^ set(want))} differ"
    flows = max(ah.max_abs(g) for g in want.values())
    for name, grad in want.items():
        ah.assert_close_ulps(
            got[name], grad, dtype=torch.float32, ulps=ulps, scale=flows, name=f"grad {name}", context=context
        )


@pytest.mark.parametrize("block", [5, 7, 64], ids=["block5-narrower-than-window", "block7-uneven", "block64-one"])
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_query_block_attention_equals_eager_attention_in_fp32(impl, megatron_world, layer, block):
    _, eager, blocked = _attention_pair(impl, layer, attention_chunk_threshold=0, attention_query_block=block)
    seq = 48
    gen = torch.Generator().manual_seed(100 + layer)
    x = torch.randn(2, seq, eager.v4.hidden_size, generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(2, -1)
    want_out, want_dx, want_grads = _run_attention(eager, x, positions)
    got_out, got_dx, got_grads = _run_attention(blocked, x, positions)
    where = f"layer {layer} block {block}"
    ah.assert_close_ulps(got_out, want_out, dtype=torch.float32, ulps=BLOCK_ULPS, name="output", context=where)
    ah.assert_close_ulps(got_dx, want_dx, dtype=torch.float32, ulps=BLOCK_ULPS, name="input gradient", context=where)
    _assert_gradients_close(got_grads, want_grads, ulps=BLOCK_ULPS, context=where)


def test_query_block_attention_keeps_far_fewer_bytes_than_eager_scores(impl, megatron_world):
    """At 256 tokens the eager CSA layer keeps [B,H,S,S+W] scores; the block path with core_attn recompute does not."""
    _, eager, blocked = _attention_pair(
        impl,
        1,
        attention_chunk_threshold=0,
        attention_query_block=32,
        recompute_granularity="selective",
        recompute_modules=("core_attn",),
    )
    seq = 256
    device = next(eager.parameters()).device
    x = torch.randn(1, seq, eager.v4.hidden_size, device=device).requires_grad_(True)
    positions = torch.arange(seq, device=device).unsqueeze(0)
    _, eager_bytes = saved_bytes(lambda: eager(x, positions), param_storages(eager))
    _, blocked_bytes = saved_bytes(lambda: blocked(x, positions), param_storages(blocked))
    heads = eager.num_heads_local
    scores = heads * seq * seq * 4  # one fp32 [H, S, S] score tensor, without the entries
    assert eager_bytes > scores, f"eager attention kept only {eager_bytes} bytes; the eager path was not taken"
    assert eager_bytes - blocked_bytes >= scores, (
        f"block path kept {blocked_bytes} bytes vs eager {eager_bytes}: it saves less than one [H,S,S] score tensor"
    )


def _model(impl, plan: dict):
    cfg = get_preset(PRESET)
    torch.manual_seed(0)
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(cfg), activations=impl.ActivationPlan(**plan))
    _randomize(model, seed=7)
    return cfg, model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    params = param_storages(model)
    loss, kept = saved_bytes(lambda: model(ids, labels=torch.roll(ids, -1, dims=1)).mean(), params)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}, kept


@pytest.mark.parametrize("plan", sorted(RECOMPUTE_PLANS))
def test_recompute_changes_memory_not_the_loss_or_any_gradient(impl, megatron_world, plan):
    cfg, base = _model(impl, {})
    _, recomputed = _model(impl, RECOMPUTE_PLANS[plan])
    recomputed.load_state_dict(base.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, min_seq_len(cfg)), generator=torch.Generator().manual_seed(1))
    ids = ids.to(next(base.parameters()).device)
    want_loss, want_grads, want_kept = _loss_and_grads(base, ids)
    got_loss, got_grads, got_kept = _loss_and_grads(recomputed, ids)
    assert torch.equal(got_loss, want_loss), f"{plan}: loss {got_loss.item()} != {want_loss.item()}"
    _assert_gradients_close(got_grads, want_grads, ulps=RECOMPUTE_ULPS, context=plan)
    assert got_kept < want_kept, f"{plan}: kept {got_kept} bytes for backward, no recompute keeps {want_kept}"


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (dict(recompute_granularity="partial"), "recompute_granularity"),
        (dict(recompute_granularity="full", recompute_method="interleaved"), "recompute_method"),
        (dict(recompute_granularity="selective", recompute_modules=("mlp",)), "recompute_modules"),
        (dict(recompute_granularity="selective"), "needs recompute_modules"),
        (dict(attention_query_block=0), "attention_query_block"),
    ],
    ids=["granularity", "method", "module", "selective-without-modules", "block"],
)
def test_unsupported_activation_plans_are_rejected_by_name(impl, plan, match):
    with pytest.raises(impl.UnsupportedConfigError, match=match):
        impl.ActivationPlan(**plan)
