"""The native DeepSeek-V4 graph (hyper-connections, MoE, decoder layers, model, MTP) reproduces transformers'
``DeepseekV4ForCausalLM`` on the same random weights: single rank, pipeline stages, and TP=2 / EP=2 on gloo."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fixtures.asserts as ah
from fixtures.data.native_weights import (
    ensure_single_rank_megatron,
    load_hf_into_native,
    load_hf_moe_into_native,
    oracle_counterparts,
)
from fixtures.runner.impl_loader import load_impl
from fixtures.runner.multirank import impl_preload, init_megatron_parallel, run_ranks
from tiny_models import build_random_model, get_preset, min_seq_len

pytestmark = pytest.mark.cpu

#: units of eps(float32) * max|oracle logits|: two independent fp32 forwards of the whole model differ by rounding,
#: up to ~32 units per side (test_native_oracle_property's analysis), so 128 as there
LOGIT_ULPS = 128
#: units of eps(float32) * max|oracle output| for one hyper-connection or MoE block: a few roundings per reduction
#: on each side (RMS norm, matmul, expert sums; Sinkhorn's row and column normalisations, a random walk over its
#: iterations); 16 leaves room
UNIT_ULPS = 16
#: units of eps(float32) * the rank's largest oracle gradient, for every parameter: a backward rounds relative to
#: the flows it sums, not to the one result (small gradients such as hc_*_scale are differences of large terms),
#: and the largest gradient is the size of those flows; a few units per reduction through every layer, 48 leaves room
GRAD_ULPS = 48
#: the effects relied on (comb's asymmetry, one layer's attention) must exceed the tolerance this many times
EFFECT_FACTOR = 10
# The lightning indexer returns integer top-k picks: no gradient reaches it through attention (V4 trains it
# with its own loss), so its parameters are the only trainable ones allowed to have no gradient here.
GRADLESS_BY_DESIGN = ".self_attention.indexer."


@pytest.fixture(scope="module")
def native(impl):
    ensure_single_rank_megatron(impl)
    return impl


@pytest.fixture(scope="module")
def mixed():
    """tiny-mixed: SWA/CSA/HCA(16)/CSA, 2 hash + 2 score-routed layers, hc_mult 4, o_groups 2, YaRN."""
    return build_random_model("tiny-mixed", seed=0)


def _ids(cfg, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _native_from(native, hf, **kwargs):
    torch.manual_seed(1)
    model = native.DeepseekV4NativeModel(native.V4Config.from_hf(hf.config), **kwargs).eval()
    load_hf_into_native(model, hf)
    return model


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------- hyper-connections


def test_hyper_connection_pre_matches_oracle(native, mixed):
    hc_mod = mixed.model.layers[1].attn_hc
    cfg = mixed.config
    x = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    post_ref, comb_ref, u_ref = hc_mod(x)
    post, comb, u = native.hc_pre(
        x,
        hc_mod.fn,
        hc_mod.base,
        hc_mod.scale,
        hc_mult=cfg.hc_mult,
        sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        norm_eps=cfg.rms_norm_eps,
    )
    for what, got, ref in (("post", post, post_ref), ("comb", comb, comb_ref), ("collapsed", u, u_ref)):
        assert got.dtype == ref.dtype, f"hc_pre {what}: dtype {got.dtype} != oracle {ref.dtype}"
        ah.assert_close_ulps(got, ref, dtype=torch.float32, ulps=UNIT_ULPS, name=f"hc_pre {what} vs attn_hc")
    # comb must not be symmetric, or hc_post's transpose (sum over the first index) would go untested: its asymmetry
    # must stand well above the rounding comb is compared at, so a transposed comb is a defect, not noise.
    comb_tol = ah.ulp_tolerance(torch.float32, ulps=UNIT_ULPS, scale=ah.max_abs(comb_ref))
    ah.assert_effect_exceeds(
        _maxdiff(comb, comb.transpose(-1, -2)), comb_tol, factor=EFFECT_FACTOR, what="comb's asymmetry (hc_post order)"
    )


def test_hyper_head_matches_oracle(native, mixed):
    ref_mod = mixed.model.hc_head
    head = native.HyperHead(native.V4Config.from_hf(mixed.config))
    with torch.no_grad():
        head.hc_head_fn.copy_(ref_mod.hc_fn)
        head.hc_head_base.copy_(ref_mod.hc_base)
        head.hc_head_scale.copy_(ref_mod.hc_scale)
    x = torch.randn(2, 7, mixed.config.hc_mult, mixed.config.hidden_size, generator=torch.Generator().manual_seed(6))
    ah.assert_close_ulps(
        head(x), ref_mod(x), dtype=torch.float32, ulps=UNIT_ULPS, name="decoder.hc_head_params collapse vs hc_head"
    )


# --------------------------------------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("layer", [0, 2], ids=["hash-routed", "score-routed"])
def test_moe_block_matches_oracle(native, mixed, layer):
    cfg = mixed.config
    hf_moe = mixed.model.layers[layer].mlp
    moe = native.V4MoE(native.V4Config.from_hf(cfg), hash_routed=layer < 2)
    load_hf_moe_into_native(moe, hf_moe)
    gen = torch.Generator().manual_seed(7 + layer)
    # Large activations so the SwiGLU clamps (gate <= limit, |up| <= limit) bind on some tokens.
    x = 6.0 * torch.randn(2, 24, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    gate_up = F.linear(x.flatten(0, 1), hf_moe.experts.gate_up_proj[0])
    assert (gate_up.abs() > cfg.swiglu_limit).any(), "test input too small: the swiglu clamp never binds"
    with torch.no_grad():
        ref = hf_moe(x, input_ids=ids)
        got = moe(x, ids)
    ah.assert_close_ulps(
        got, ref, dtype=torch.float32, ulps=UNIT_ULPS, name="MoE output vs the oracle", context=f"layer {layer}"
    )


def test_expert_parameters_are_marked_expert_parallel(native, mixed):
    moe = native.V4MoE(native.V4Config.from_hf(mixed.config), hash_routed=False)
    for name, p in moe.named_parameters():
        expected = not name.startswith("experts.")
        assert getattr(p, "allreduce", True) is expected, f"mlp.{name}: allreduce should be {expected}"
    assert moe.router.expert_bias.dtype == torch.float32, "mlp.router.expert_bias must stay fp32"


# ------------------------------------------------------------------------------------------------- full model


@pytest.mark.parametrize("preset", ["tiny-mixed", "tiny-tp", "tiny-sliding"])
def test_full_model_logits_match_oracle(native, preset):
    hf = build_random_model(preset, seed=0)
    model = _native_from(native, hf)
    ids = _ids(hf.config, 2, min_seq_len(hf.config), seed=3)
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32, f"{preset}: logits {got.shape} {got.dtype}"
    tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=ah.max_abs(ref))
    effect, layer = ah.least_layer_effect(hf, ids, ref)
    ah.assert_effect_exceeds(
        effect, tolerance, factor=EFFECT_FACTOR, what=f"layer {layer}'s attention output", context=preset
    )
    ah.assert_close_ulps(
        got, ref, dtype=torch.float32, ulps=LOGIT_ULPS, name="native logits vs the oracle", context=preset
    )


def test_per_token_loss_matches_oracle_cross_entropy(native, mixed):
    model = _native_from(native, mixed)
    ids = _ids(mixed.config, 2, 48, seed=4)
    labels = _ids(mixed.config, 2, 48, seed=5)
    with torch.no_grad():
        logits = mixed(ids).logits
        ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 48)
        got = model(ids, labels=labels)
    assert got.shape == (2, 48), f"per-token loss has shape {tuple(got.shape)}"
    # Cross entropy moves by at most 2 max|Δ logit| per token (its gradient softmax - onehot has L1 norm <= 2), so
    # the logits' tolerance doubled, at the oracle logits' scale.
    ah.assert_close_ulps(
        got,
        ref,
        dtype=torch.float32,
        ulps=2 * LOGIT_ULPS,
        scale=ah.max_abs(logits),
        name="per-token loss vs the oracle's cross entropy",
    )


def test_pipeline_stages_chain_to_the_oracle_logits(native, mixed):
    first = _native_from(native, mixed, post_process=False, layer_numbers=[0, 1])
    last = _native_from(native, mixed, pre_process=False, layer_numbers=[2, 3], include_mtp=False)
    names = {n for n, _ in last.named_parameters()}
    assert "decoder.layers.2.hc_attn_fn" in names and "decoder.layers.0.hc_attn_fn" not in names, (
        "a stage must keep global layer numbers in its parameter names"
    )
    assert not hasattr(last, "embedding") and not hasattr(first, "output_layer"), "stage built the wrong ends"
    ids = _ids(mixed.config, 1, 48, seed=8)
    with torch.no_grad():
        streams = first(ids)
        assert streams.shape == (1, 48, mixed.config.hc_mult, mixed.config.hidden_size), "stage-0 output shape"
        last.set_input_tensor(streams)
        got = last(ids)
        ref = mixed(ids).logits
    ah.assert_close_ulps(got, ref, dtype=torch.float32, ulps=LOGIT_ULPS, name="two-stage logits vs the oracle")


def test_native_parameter_names_and_dtypes_follow_design(native, mixed):
    model = native.DeepseekV4NativeModel(native.V4Config.from_hf(mixed.config))
    sd = model.state_dict()
    expected = [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.router.tid2eid",
        "decoder.layers.2.mlp.router.expert_bias",
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.3.mlp.shared_experts.linear_fc2.weight",
        "decoder.layers.1.hc_ffn_scale",
        "decoder.hc_head_params.hc_head_fn",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.0.e_proj.weight",
        "mtp.layers.0.h_proj.weight",
        "mtp.layers.0.final_layernorm.weight",
        "mtp.layers.0.hc_head_params.hc_head_base",
        "mtp.layers.0.mtp_model_layer.mlp.router.expert_bias",
        "mtp.layers.0.mtp_model_layer.hc_attn_fn",
    ]
    missing = [n for n in expected if n not in sd]
    assert not missing, f"native names missing: {missing}"
    assert "decoder.layers.0.mlp.router.expert_bias" not in sd, "hash layer 0 must not carry expert_bias"
    assert "mtp.layers.0.mtp_model_layer.mlp.router.tid2eid" not in sd, "the MTP layer is score-routed"
    assert not any(".compressor." in n for n in sd if n.startswith("mtp.")), "the MTP layer is sliding-only"
    d = mixed.config.hidden_size
    assert sd["decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (
        2 * mixed.config.moe_intermediate_size,
        d,
    ), "linear_fc1 must be cat(w1, w3) [2I, d]"
    assert sd["decoder.layers.0.mlp.router.tid2eid"].dtype == torch.int64, "tid2eid must be int64"
    for n, t in sd.items():
        if ".hc_" in n or n.split(".")[-1].startswith("hc_"):
            assert t.dtype == torch.float32, f"{n}: hyper-connection params must be fp32, got {t.dtype}"


def test_backward_gives_every_trainable_parameter_a_finite_gradient(native, mixed):
    model = _native_from(native, mixed).train()
    ids = _ids(mixed.config, 2, 48, seed=9)
    labels = torch.roll(ids, -1, dims=1)
    main_loss = model(ids, labels=labels).mean()
    streams = model.forward_streams(ids)
    mtp_logits = model.forward_mtp(streams, labels)
    assert mtp_logits.shape == (2, 48, mixed.config.vocab_size), f"MTP logits shape {tuple(mtp_logits.shape)}"
    assert torch.isfinite(mtp_logits).all(), "MTP logits are not finite"
    (main_loss + F.cross_entropy(mtp_logits.flatten(0, 1), torch.roll(labels, -1, 1).flatten())).backward()
    problems = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            if GRADLESS_BY_DESIGN not in name:
                problems.append(f"{name}: no gradient")
        elif not torch.isfinite(p.grad).all():
            problems.append(f"{name}: non-finite gradient")
    assert not problems, "\n".join(problems)
    assert model.mtp.layers[0].e_proj.weight.grad.abs().sum() > 0, "MTP e_proj got a zero gradient"


def test_unsupported_parallel_layouts_are_rejected(impl, native, mixed):
    cfg = native.V4Config.from_hf(mixed.config)  # vocab 256, 4 experts
    with pytest.raises(impl.UnsupportedConfigError, match="vocab_size=256"):
        native.validate_parallel_layout(cfg, tp_size=3, ep_size=1)
    with pytest.raises(impl.UnsupportedConfigError, match="n_routed_experts=4"):
        native.validate_parallel_layout(cfg, tp_size=1, ep_size=3)
    native.validate_parallel_layout(cfg, tp_size=2, ep_size=4)  # a valid layout passes


# ---------------------------------------------------------------------------------------------- TP / EP ranks


@dataclass(frozen=True)
class ParallelCase:
    impl_name: str
    preset: str
    tp: int
    ep: int
    distinct_batches: bool  # True: rank r runs batch r (EP across data-parallel ranks); False: identical inputs
    seq: int


def _rank_native_parallel(rank: int, world_size: int, case: ParallelCase) -> dict:
    api = load_impl(case.impl_name)  # prepares the host (CPU shims) before megatron-core runs
    from megatron.core import parallel_state

    init_megatron_parallel(tp=case.tp, ep=case.ep)
    hf = build_random_model(case.preset, seed=0)
    tp_rank, tp_size = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    torch.manual_seed(1)
    model = api.DeepseekV4NativeModel(api.V4Config.from_hf(hf.config), include_mtp=False)
    load_hf_into_native(model, hf, tp_rank=tp_rank, tp_size=tp_size)

    batches = [_ids(hf.config, 1, case.seq, seed=20 + r) for r in range(world_size)]
    ids = batches[rank] if case.distinct_batches else batches[0]
    labels = torch.roll(ids, -1, dims=1)
    logits = model(ids)
    with torch.no_grad():
        ref = hf(ids).logits
    loss = model(ids, labels=labels).sum()
    loss.backward()

    def oracle_grads(batch_ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        hf.zero_grad(set_to_none=True)
        for b in batch_ids:
            out = hf(b).logits
            F.cross_entropy(out.flatten(0, 1), torch.roll(b, -1, 1).flatten(), reduction="sum").backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf.named_parameters()}
        grads.update(dict(hf.named_buffers()))
        return oracle_counterparts(model, grads, tp_rank=tp_rank, tp_size=tp_size, params_only=True)

    own = oracle_grads([ids])
    # Expert grads sum over every token the expert saw: all EP ranks' batches when they differ.
    experts = oracle_grads(batches) if case.distinct_batches else own
    grad_err, missing = {}, []
    for name, p in model.named_parameters():
        if p.grad is None:
            if GRADLESS_BY_DESIGN not in name:
                missing.append(name)
            continue
        ref_g = (experts if ".mlp.experts." in name else own)[name]
        grad_err[name] = (_maxdiff(p.grad, ref_g), ah.max_abs(ref_g))  # (max|Δ|, the oracle gradient's scale)
    return {
        "logit_diff": _maxdiff(logits, ref),
        "logit_scale": ah.max_abs(ref),
        "grad_err": grad_err,
        "missing_grads": missing,
        "local_experts": model.decoder.layers[0].mlp.experts.local_expert_offset,
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("tp", "ep", "distinct", "world"),
    [(2, 2, False, 2), (1, 2, True, 2), (2, 2, False, 4)],
    ids=["tp2-ep2-same-inputs", "ep2-per-rank-batches", "tp2xep2-4-ranks"],
)
def test_tensor_and_expert_parallel_ranks_reproduce_the_oracle(impl, nproc, tp, ep, distinct, world):
    if world > nproc:
        pytest.skip(f"needs --nproc {world} (running with --nproc {nproc})")
    case = ParallelCase(impl.name, "tiny-tp", tp, ep, distinct, seq=min_seq_len(get_preset("tiny-tp")))
    results = run_ranks(_rank_native_parallel, case, nproc=world, timeout_s=300, preload=impl_preload(impl.name))
    offsets = sorted({r.payload["local_experts"] for r in results})
    assert offsets == [0, 4], f"EP ranks must own contiguous halves of the 8 experts, got offsets {offsets}"
    for r in results:
        p = r.payload
        ah.assert_within_ulps(
            p["logit_diff"],
            dtype=torch.float32,
            ulps=LOGIT_ULPS,
            scale=p["logit_scale"],
            what="logits vs the oracle",
            context=f"rank {r.rank}",
        )
        assert not p["missing_grads"], f"rank {r.rank}: no gradient for {p['missing_grads']}"
        flows = max(scale for _, scale in p["grad_err"].values())
        grad_tol = ah.ulp_tolerance(torch.float32, ulps=GRAD_ULPS, scale=flows)
        bad = {n: f"{diff:.2e}" for n, (diff, _) in p["grad_err"].items() if not diff <= grad_tol}
        assert not bad, (
            f"rank {r.rank}: gradients differ from the oracle's by more than {GRAD_ULPS} units of eps(float32) * "
            f"{flows:.3g} (the largest oracle gradient) = {grad_tol:.2e}: {bad}"
        )
