"""The native V4 attention computes exactly what transformers' ``DeepseekV4Attention`` computes.

Oracle: transformers 5.12.1 ``DeepseekV4Attention`` (sliding, CSA with its indexer, HCA) with every parameter
randomized, fed the position embeddings and sliding-window mask that ``DeepseekV4Model`` builds. Native
weights are copied in by name; outputs and gradients are compared in fp32 at TP=1 and, per rank, at TP=2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import fixtures.asserts as ah
from fixtures.data.native_weights import ensure_single_rank_megatron
from fixtures.runner.multirank import impl_preload, init_megatron_parallel, run_ranks

pytestmark = pytest.mark.cpu

#: units of eps(float32) * max|oracle output| for one attention forward: a few roundings per reduction on each side
#: (projections, norms, softmax, compressor pooling); 8 leaves room
OUT_ULPS = 8
#: units of eps(float32) * the layer's largest oracle gradient, for every parameter: a backward rounds relative to
#: the flows it sums, not to one small result; a unit or two per reduction, 8 leaves room
GRAD_ULPS = 8
#: units of eps(float32) at |x| = 1 for one interleaved rotation (cos, sin, two products and a sum per channel);
#: rope then inverse rope is two of them, 8 leaves room
ROPE_ULPS = 8
#: units of eps(float32) * max|reference| for one 5-term dot product per output on each side: 4 leaves room
DOT_ULPS = 4
#: the effects relied on (a rope pair's rotation, another wo_a group's contribution) must exceed the tolerance
#: this many times, or the comparison could not tell them from rounding
EFFECT_FACTOR = 10
SEQ = 40  # CSA(4): 10 entries > index_topk 3, so the indexer really chooses; HCA(8): 5 entries
BATCH = 2
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}

# native parameter name -> transformers DeepseekV4Attention parameter name (this unit's own table)
HF_NAME = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight",
    "attn_sink": "sinks",
    "compressor.ape": "compressor.position_bias",
    "compressor.wkv.weight": "compressor.kv_proj.weight",
    "compressor.wgate.weight": "compressor.gate_proj.weight",
    "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.linear_wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.linear_weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}


# ----------------------------------------------------------------------------------------------- helpers


def _hf_config(**overrides: Any) -> Any:
    """Layers: sliding, CSA (ratio 4, indexer top-3 of 2x16), HCA (ratio 8); 4 heads x 16, rope 8, 2 o-groups."""
    from transformers import DeepseekV4Config

    fields: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=12,
        sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["moe"] * 3,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        max_position_embeddings=64,
        num_nextn_predict_layers=0,
    )
    fields.update(overrides)
    hf = DeepseekV4Config(**fields)
    hf._attn_implementation = "eager"  # V4 ships eager only
    return hf


def _oracle(hf: Any, layer: int, *, seed: int) -> Any:
    """transformers' attention for ``layer`` with every parameter random (sinks, position_bias, norms too)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttention

    gen = torch.Generator().manual_seed(seed)
    ref = HFAttention(hf, layer).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and not name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:  # sinks, position_bias
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return ref


def _inputs(hf: Any, *, seed: int, batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq, hf.hidden_size, generator=gen)
    return x, torch.arange(seq).unsqueeze(0).expand(batch, -1)


def _oracle_forward(ref: Any, hf: Any, x: torch.Tensor, positions: torch.Tensor, *, with_cache: bool) -> torch.Tensor:
    """Call the oracle the way ``DeepseekV4Model`` does: per-rope-type cos/sin dict and the sliding-window mask."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cache = DynamicCache(config=hf) if with_cache else None
    rotary = DeepseekV4RotaryEmbedding(hf)
    embeddings = {kind: rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=hf, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=positions
    )
    out, _ = ref(x, position_embeddings=embeddings, position_ids=positions, attention_mask=mask, past_key_values=cache)
    return out


def _shard(full: torch.Tensor, target: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of an oracle tensor when the native one is TP-partitioned (Megatron's attributes)."""
    if tp_size > 1 and getattr(target, "tensor_model_parallel", False):
        return full.chunk(tp_size, dim=target.partition_dim)[tp_rank]
    return full


@torch.no_grad()
def _load(native: torch.nn.Module, ref: torch.nn.Module, *, tp_rank: int = 0, tp_size: int = 1) -> None:
    oracle = dict(ref.named_parameters())
    own = dict(native.named_parameters())
    missing = sorted(set(own) - set(HF_NAME))
    assert not missing, f"native attention parameters without an oracle counterpart: {missing}"
    expected = {n for n, h in HF_NAME.items() if h in oracle}
    assert set(own) == expected, f"native parameters {sorted(own)} != expected {sorted(expected)}"
    for name, param in own.items():
        part = _shard(oracle[HF_NAME[name]], param, tp_rank, tp_size)
        assert part.shape == param.shape, f"{name}: oracle slice {tuple(part.shape)} vs native {tuple(param.shape)}"
        param.copy_(part)


def _pair_and_inputs(impl: Any, hf: Any, layer: int, *, seed: int, input_seed: int) -> tuple[Any, Any, Any, Any]:
    """transformers' attention for ``layer`` (random, from ``seed``), the native one loaded from it, and inputs
    ``x, positions`` (from ``input_seed``)."""
    ref = _oracle(hf, layer, seed=seed)
    native = impl.DeepseekV4Attention(impl.V4Config.from_hf(hf), layer)
    _load(native, ref)
    return ref, native, *_inputs(hf, seed=input_seed)


@pytest.fixture(scope="module")
def megatron_world(impl) -> None:
    ensure_single_rank_megatron(impl)


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "fresh-dynamic-cache"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_output_matches_transformers_attention(impl, megatron_world, kind, with_cache):
    hf = _hf_config()
    layer = LAYERS[kind]
    ref, native, x, positions = _pair_and_inputs(impl, hf, layer, seed=10 + layer, input_seed=layer)
    with torch.no_grad():
        expected = _oracle_forward(ref, hf, x, positions, with_cache=with_cache)
        got = native(x, positions)
    assert got.shape == expected.shape == x.shape
    ah.assert_close_ulps(
        got,
        expected,
        dtype=torch.float32,
        ulps=OUT_ULPS,
        name="attention output vs transformers",
        context=f"{kind} layer {layer}",
    )


def test_one_dimensional_position_ids_broadcast_over_the_batch(impl, megatron_world):
    hf = _hf_config()
    ref, native, x, positions = _pair_and_inputs(impl, hf, LAYERS["csa"], seed=3, input_seed=3)
    with torch.no_grad():
        expected = _oracle_forward(ref, hf, x, positions, with_cache=False)
        got = native(x, positions[0])
    ah.assert_close_ulps(
        got, expected, dtype=torch.float32, ulps=OUT_ULPS, name="attention output", context="position_ids of shape [S]"
    )


def test_indexer_keeps_only_top_k_of_the_visible_compressed_entries(impl, megatron_world):
    """At SEQ=40 the CSA layer's later queries see more entries than index_topk: some must be left out."""
    hf = _hf_config()
    _, native, x, positions = _pair_and_inputs(impl, hf, LAYERS["csa"], seed=11, input_seed=1)
    with torch.no_grad():
        qr = native.q_norm(native.wq_a(x))
        inv_freq = impl.rope_inv_freq(native.v4, compressed=True)
        picks = native.indexer(x, qr, positions, inv_freq)
    visible = (positions + 1) // 4
    assert picks.shape == (BATCH, SEQ, hf.index_topk)
    assert bool((picks < visible.unsqueeze(-1)).all()), "indexer picked a compressed entry a query may not see"
    chosen = (picks >= 0).sum(-1)
    assert bool((chosen == visible.clamp(max=hf.index_topk)).all()), "indexer left a free top-k slot unused"
    assert int(visible.max()) > hf.index_topk, "sequence too short: the indexer never has to choose"


@pytest.mark.parametrize("rope_dim", [2, 8, 16], ids=["rope2of16", "rope8of16", "rope16of16"])
def test_rope_rotates_exactly_the_last_rope_head_dim_channels(impl, rope_dim):
    """All ``qk_rope_head_dim`` trailing channels rotate (pairwise), none of the leading ones, whatever the fraction."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = _hf_config(qk_rope_head_dim=rope_dim)
    cfg = impl.V4Config.from_hf(hf)
    assert cfg.rope_head_dim == rope_dim
    rotary = DeepseekV4RotaryEmbedding(hf)
    for kind, compressed in (("main", False), ("compress", True)):
        inv_freq = impl.rope_inv_freq(cfg, compressed=compressed)
        oracle = getattr(rotary, f"{kind}_inv_freq")
        assert inv_freq.shape == (rope_dim // 2,), f"{kind}: {tuple(inv_freq.shape)} frequencies for rope {rope_dim}"
        assert torch.equal(inv_freq, oracle), f"{kind} inverse frequencies differ from transformers"
    positions = torch.tensor([[3]])
    inv_freq = impl.rope_inv_freq(cfg, compressed=False)
    angles = inv_freq[None, None, :] * positions[..., None].float()
    x = torch.ones(1, 1, hf.head_dim)
    y = impl.apply_interleaved_rope(x, angles.cos(), angles.sin())
    nope = hf.head_dim - rope_dim
    assert torch.equal(y[..., :nope], x[..., :nope]), "rope touched a leading (nope) channel"
    moved = (y[..., nope:] - x[..., nope:]).abs().view(-1, 2).amax(-1)
    tolerance = ah.ulp_tolerance(torch.float32, ulps=ROPE_ULPS, scale=1.0)  # |x| = 1
    least = int(moved.argmin())
    ah.assert_effect_exceeds(
        float(moved[least]), tolerance, factor=EFFECT_FACTOR, what=f"rope pair {least}'s rotation (else unrotated)"
    )
    back = impl.apply_interleaved_rope(y, angles.cos(), angles.sin(), inverse=True)
    ah.assert_close_ulps(back, x, dtype=torch.float32, ulps=ROPE_ULPS, name="inverse rope of rope", scale=1.0)


@pytest.mark.parametrize("rope_dim", [4, 16], ids=["rope4of16", "full-head-rope"])
def test_output_matches_transformers_for_other_rope_widths(impl, megatron_world, rope_dim):
    hf = _hf_config(qk_rope_head_dim=rope_dim)
    for kind, layer in LAYERS.items():
        ref, native, x, positions = _pair_and_inputs(impl, hf, layer, seed=20 + layer, input_seed=layer)
        with torch.no_grad():
            got, expected = native(x, positions), _oracle_forward(ref, hf, x, positions, with_cache=False)
        ah.assert_close_ulps(
            got,
            expected,
            dtype=torch.float32,
            ulps=OUT_ULPS,
            name="attention output",
            context=f"rope {rope_dim}, {kind} layer {layer}",
        )


@pytest.mark.parametrize("kind", list(LAYERS))
def test_gradients_are_finite_and_match_transformers(impl, megatron_world, kind):
    """Every parameter's gradient equals the oracle's; the indexer gets none (top-k indices), as in the oracle."""
    hf = _hf_config()
    layer = LAYERS[kind]
    ref, native, x, positions = _pair_and_inputs(impl, hf, layer, seed=30 + layer, input_seed=layer)
    weight = torch.randn(BATCH, SEQ, hf.hidden_size, generator=torch.Generator().manual_seed(7))
    (_oracle_forward(ref, hf, x, positions, with_cache=False) * weight).sum().backward()
    (native(x, positions) * weight).sum().backward()
    oracle = dict(ref.named_parameters())
    flows = max(ah.max_abs(p.grad) for p in oracle.values() if p.grad is not None)  # the largest oracle gradient
    for name, param in native.named_parameters():
        expected = oracle[HF_NAME[name]].grad
        if name.startswith("indexer."):
            assert param.grad is None and expected is None, f"{kind}: {name} got a gradient through top-k indices"
            continue
        assert param.grad is not None, f"{kind}: {name} has no gradient"
        assert bool(torch.isfinite(param.grad).all()), f"{kind}: {name} has a non-finite gradient"
        assert float(param.grad.abs().max()) > 0, f"{kind}: {name} has an all-zero gradient"
        ah.assert_close_ulps(
            param.grad, expected, dtype=torch.float32, ulps=GRAD_ULPS, scale=flows, name=f"grad {name}", context=kind
        )


def test_grouped_wo_a_is_block_diagonal(impl):
    """Group g's output depends only on head block g: the grouped projection, not a dense matmul."""
    groups, rank_out, per_group = 3, 4, 5
    module = impl.ReplicatedLinear(per_group, groups * rank_out)
    x = torch.randn(2, 6, groups, per_group)
    got = impl.grouped_wo_a(module, x, groups=groups, group_out=rank_out)
    w = module.weight.view(groups, rank_out, per_group)
    for g in range(groups):
        expected = x[:, :, g] @ w[g].T
        # what mixing would add is another group's product, which must stand above the rounding
        tolerance = ah.assert_close_ulps(
            got[:, :, g], expected, dtype=torch.float32, ulps=DOT_ULPS, name=f"wo_a group {g} (mixes other groups?)"
        )
        other = min(ah.max_abs(x[:, :, h] @ w[g].T) for h in range(groups) if h != g)
        ah.assert_effect_exceeds(other, tolerance, factor=EFFECT_FACTOR, what=f"another group mixed into group {g}")


def test_grouped_wo_a_rejects_a_weight_of_the_wrong_group_layout(impl):
    module = impl.ReplicatedLinear(5, 3 * 4)
    with pytest.raises(impl.GroupedLoRAError, match=r"wo_a\.weight"):
        impl.grouped_wo_a(module, torch.randn(1, 2, 2, 5), groups=2, group_out=4)


class _Wrapper(torch.nn.Module):
    """A module wrapping ``wo_a`` the way an adapter does (``to_wrap``), with or without the grouped hook."""

    def __init__(self, base: torch.nn.Module, hook: bool) -> None:
        super().__init__()
        self.to_wrap = base
        if hook:
            self.grouped_forward = lambda x, *, groups, group_out: torch.full((*x.shape[:-1], group_out), 7.0)


def test_a_wrapped_wo_a_runs_through_its_wrappers_grouped_forward(impl):
    """The base graph knows no adapter: a wrapper of ``wo_a`` computes the grouped product through its hook."""
    wrapped = _Wrapper(impl.ReplicatedLinear(5, 3 * 4), hook=True)
    got = impl.grouped_wo_a(wrapped, torch.randn(1, 2, 3, 5), groups=3, group_out=4)
    assert torch.equal(got, torch.full((1, 2, 3, 4), 7.0)), "the wrapper's grouped_forward was not what ran"


def test_a_wrapper_of_wo_a_without_the_grouped_hook_is_refused_not_dropped(impl):
    wrapped = _Wrapper(impl.ReplicatedLinear(5, 3 * 4), hook=False)
    with pytest.raises(impl.GroupedLoRAError, match=r"_Wrapper.*grouped_forward"):
        impl.grouped_wo_a(wrapped, torch.randn(1, 2, 3, 5), groups=3, group_out=4)


def test_heads_not_divisible_by_o_groups_are_rejected(impl, megatron_world):
    hf = _hf_config(num_attention_heads=6, o_groups=4)
    with pytest.raises(impl.UnsupportedConfigError, match=r"num_heads=6.*o_groups=4"):
        impl.DeepseekV4Attention(impl.V4Config.from_hf(hf), 0)


def test_bad_position_ids_are_rejected(impl, megatron_world):
    hf = _hf_config()
    attention = impl.DeepseekV4Attention(impl.V4Config.from_hf(hf), 0)
    x = torch.randn(1, 8, hf.hidden_size)
    with pytest.raises(impl.Dsv4Error, match=r"position_ids has shape \(5,\)"):
        attention(x, torch.arange(5))
    with pytest.raises(impl.Dsv4Error, match="integer"):
        attention(x, torch.arange(8.0))


def test_mtp_override_builds_a_sliding_layer(impl, megatron_world):
    """``compress_ratio=0`` (the MTP layer) drops compressor and indexer from a compressed layer's slot."""
    hf = _hf_config()
    attention = impl.DeepseekV4Attention(impl.V4Config.from_hf(hf), LAYERS["csa"], compress_ratio=0)
    names = {n for n, _ in attention.named_parameters()}
    assert not {n for n in names if n.startswith(("compressor.", "indexer."))}, f"unexpected: {sorted(names)}"


# ------------------------------------------------------------------------------------------ TP=2 (gloo)


@dataclass(frozen=True)
class TPCase:
    impl_name: str
    layers: tuple[int, ...]
    seed: int = 0


def _rank_attention_tp(rank: int, world_size: int, case: TPCase) -> dict[str, Any]:
    from fixtures.runner.impl_loader import load_impl

    impl = load_impl(case.impl_name)  # imports the implementation (CPU shims) before Megatron runs
    init_megatron_parallel(tp=world_size)
    hf = _hf_config()
    errors: dict[str, Any] = {}
    for layer in case.layers:
        ref = _oracle(hf, layer, seed=case.seed + layer)  # same seed on every rank: one model, split over TP
        native = impl.DeepseekV4Attention(impl.V4Config.from_hf(hf), layer)
        _load(native, ref, tp_rank=rank, tp_size=world_size)
        x, positions = _inputs(hf, seed=layer)
        weight = torch.randn(BATCH, SEQ, hf.hidden_size, generator=torch.Generator().manual_seed(7))
        expected = _oracle_forward(ref, hf, x, positions, with_cache=False)
        got = native(x, positions)
        errors[f"layer{layer}.out"] = (ah.max_abs(got - expected), ah.max_abs(expected))  # (max|Δ|, scale)
        (expected * weight).sum().backward()
        (got * weight).sum().backward()
        oracle = dict(ref.named_parameters())
        flows = max(ah.max_abs(p.grad) for p in oracle.values() if p.grad is not None)
        for name, param in native.named_parameters():
            if name.startswith("indexer."):
                continue
            full = _shard(oracle[HF_NAME[name]].grad, param, rank, world_size)
            errors[f"layer{layer}.grad.{name}"] = (ah.max_abs(param.grad - full), flows)
    try:
        impl.DeepseekV4Attention(impl.V4Config.from_hf(_hf_config(num_attention_heads=6, o_groups=3)), 0)
        errors["rejects_o_groups_3_at_tp2"] = False
    except impl.UnsupportedConfigError as exc:
        errors["rejects_o_groups_3_at_tp2"] = "o_groups=3" in str(exc) and "2" in str(exc)
    return errors


def test_tensor_parallel_attention_matches_transformers_on_every_rank(impl):
    """TP=2: heads and wo_a groups split, KV/compressor/indexer replicated; output and gradients match per rank."""
    case = TPCase(impl.name, layers=tuple(LAYERS.values()))
    results = run_ranks(_rank_attention_tp, case, nproc=2, timeout_s=240, preload=impl_preload(impl.name))
    for r in results:
        payload = dict(r.payload)
        assert payload.pop("rejects_o_groups_3_at_tp2") is True, f"rank {r.rank}: o_groups=3 at TP=2 not rejected"
        for key, (diff, scale) in payload.items():
            ah.assert_within_ulps(
                diff,
                dtype=torch.float32,
                ulps=GRAD_ULPS if ".grad." in key else OUT_ULPS,
                scale=scale,
                what=f"TP=2 {key} vs transformers",
                context=f"rank {r.rank}",
            )
