"""Tiny DeepSeek-V4 models: presets cover every V4 feature, checkpoints are official-layout, seeded,
non-degenerate, and load into the transformers oracle reproducing the in-memory model exactly."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from hypothesis import given, note
from safetensors.torch import load_file

import fixtures.asserts as ah
from fixtures.data.strategies import v4_configs
from fixtures.runner.host_state import torch_threads
from tiny_models import (
    PRESETS,
    CheckpointNameError,
    UnknownPresetError,
    build_random_model,
    get_preset,
    load_oracle,
    manifest,
    min_seq_len,
    official_state_dict,
    official_to_transformers_name,
    transformers_to_official_name,
    write_checkpoint,
)
from tiny_models.presets import CSA, HCA, SLIDING

pytestmark = pytest.mark.cpu

# Until conftest registers the plugin ``fixtures.data.tiny_checkpoint_cache`` (then delete this line).

ALL_PRESETS = sorted(PRESETS)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matmuls lose to thread hand-off on a shared 2-core host; restore the setting afterwards."""
    with torch_threads(1):
        yield


def _ids(cfg, seed: int = 0, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, min_seq_len(cfg)), generator=gen)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_checkpoint_loads_into_transformers_and_reproduces_in_memory_logits_exactly(preset, tiny_ckpt_factory):
    from transformers import DeepseekV4ForCausalLM

    ckpt = tiny_ckpt_factory(preset)
    _, info = DeepseekV4ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        stray = sorted(k for k in info[kind] if not str(k).startswith("mtp."))
        assert not stray, f"{preset}: transformers reports {kind} {stray}"
    oracle = load_oracle(ckpt)
    reference = build_random_model(preset, seed=0)
    ids = _ids(reference.config)
    with torch.no_grad():
        want, got = reference(ids).logits, oracle(ids).logits
    assert torch.isfinite(want).all(), f"{preset}: in-memory logits are not finite"
    assert want.std() > 0.1, f"{preset}: logits nearly constant (std {want.std():.3g}); the random init is degenerate"
    ah.assert_close(got, want, atol=0.0, name="logits of the reloaded checkpoint", context=preset)


def test_checkpoint_holds_mtp_tensors_transformers_ignores(tiny_ckpt_factory):
    tensors = load_file(str(tiny_ckpt_factory("tiny-mixed") / "model.safetensors"))
    mtp = {name for name in tensors if name.startswith("mtp.0.")}
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn"):
        assert f"mtp.0.{name}" in mtp, f"mtp.0.{name} missing from the checkpoint"
    assert "mtp.0.ffn.gate.bias" in mtp and "mtp.0.ffn.gate.tid2eid" not in mtp, "the MTP layer must be score-routed"
    assert not any(".compressor." in n for n in mtp), "the MTP layer must be sliding-only"


def test_degenerate_parameters_are_randomized(tiny_ckpt_factory):
    cfg = get_preset("tiny-mixed")
    tensors = load_file(str(tiny_ckpt_factory("tiny-mixed") / "model.safetensors"))
    for name, t in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn_sink", "ape", "bias") or name.endswith("_base"):
            assert (t != 0).all(), f"{name} has zeros: transformers' zero init was not randomized"
        if name.endswith("_scale") or (t.dim() == 1 and leaf == "weight"):
            assert not torch.all(t == 1), f"{name} is all ones: transformers' unit init was not randomized"
    tid2eids = {n: t for n, t in tensors.items() if n.endswith("tid2eid")}
    assert len(tid2eids) == cfg.mlp_layer_types.count("hash_moe"), "one tid2eid per hash layer"
    for name, t in tid2eids.items():
        assert t.dtype == torch.int64 and t.shape == (cfg.vocab_size, cfg.num_experts_per_tok), name
        assert t.min() >= 0 and t.max() < cfg.n_routed_experts, f"{name} holds expert ids outside [0, E)"
        distinct = torch.tensor([len(set(row.tolist())) for row in t])
        assert (distinct == cfg.num_experts_per_tok).all(), f"{name}: a row repeats an expert id"
        assert len(set(t.flatten().tolist())) == cfg.n_routed_experts, f"{name} never routes to some expert"
        assert len({tuple(r) for r in t.tolist()}) > 1, f"{name}: every token routes identically"
    first, second = list(tid2eids.values())[:2]
    assert not torch.equal(first, second), "hash layers share one tid2eid table"


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    a = write_checkpoint("tiny-sliding", tmp_path / "a", seed=7)
    b = write_checkpoint("tiny-sliding", tmp_path / "b", seed=7)
    c = write_checkpoint("tiny-sliding", tmp_path / "c", seed=8)
    for f in ("model.safetensors", "config.json"):
        assert _sha256(a / f) == _sha256(b / f), f"{f}: two writes with seed 7 differ"
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors"), "seeds 7 and 8 give the same weights"
    ta, tc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not torch.equal(ta["mtp.0.e_proj.weight"], tc["mtp.0.e_proj.weight"]), "MTP tensors ignore the seed"


def test_writing_does_not_touch_the_global_torch_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    write_checkpoint("tiny-sliding", tmp_path, seed=0)
    assert torch.equal(torch.rand(4), expected), "write_checkpoint consumed the global RNG"


def test_bf16_checkpoint_keeps_fp32_families_and_still_loads(tiny_ckpt_factory):
    ckpt = tiny_ckpt_factory("tiny-mixed", dtype=torch.bfloat16)
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    for name in ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.2.ffn.gate.bias", "hc_head_fn"):
        assert tensors[name].dtype == torch.float32, f"{name} must stay fp32 on disk"
    oracle = load_oracle(ckpt)
    with torch.no_grad():
        assert torch.isfinite(oracle(_ids(oracle.config)).logits).all(), "bf16 checkpoint gives non-finite logits"


def test_name_table_round_trips_every_one_to_one_transformers_name():
    model = build_random_model("tiny-mixed")
    names = [n for n in model.state_dict() if ".mlp.experts." not in n]
    for name in names:
        official = transformers_to_official_name(name)
        assert official_to_transformers_name(official) == name, f"{name} -> {official} does not map back"
    assert (
        official_to_transformers_name("layers.3.ffn.experts.2.w3.weight") == "model.layers.3.mlp.experts.gate_up_proj"
    )


@pytest.mark.parametrize(
    "bad", ["layers.0.attn.wq_c.weight", "mtp.0.e_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
)
def test_unknown_tensor_names_are_rejected(bad):
    convert = transformers_to_official_name if bad.startswith("model.") else official_to_transformers_name
    with pytest.raises(CheckpointNameError, match=bad.replace(".", r"\.")):
        convert(bad)


def test_fused_expert_tensor_has_no_one_to_one_official_name():
    with pytest.raises(CheckpointNameError, match="official_state_dict"):
        transformers_to_official_name("model.layers.0.mlp.experts.gate_up_proj")


def test_unknown_preset_is_rejected_with_the_list_of_presets():
    with pytest.raises(UnknownPresetError, match="tiny-mixed"):
        get_preset("tiny-huge")


# --- presets cover every V4 feature --------------------------------------------------------------------


def _configs():
    return {name: get_preset(name) for name in ALL_PRESETS}


def test_presets_cover_sliding_csa_and_hca_layers_with_a_non_legacy_hca_ratio():
    kinds = {kind for cfg in _configs().values() for kind in cfg.layer_types}
    assert {SLIDING, CSA, HCA} <= kinds
    hca_rates = {cfg.compress_rates[HCA] for cfg in _configs().values() if HCA in cfg.layer_types}
    assert hca_rates - {4, 128}, f"HCA ratios {hca_rates}: want one transformers' legacy map cannot express"
    assert all(cfg.compress_rates[CSA] == 4 for cfg in _configs().values()), "CSA overlap needs ratio 4"


def test_presets_cover_hash_and_score_routing_shared_expert_groups_streams_and_mtp():
    cfgs = _configs().values()
    for cfg in cfgs:
        n_hash = cfg.mlp_layer_types.count("hash_moe")
        assert cfg.mlp_layer_types[:n_hash] == ["hash_moe"] * n_hash, "hash layers must be a prefix"
        assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok <= cfg.n_routed_experts
        assert cfg.num_attention_heads % cfg.o_groups == 0 and cfg.qk_rope_head_dim < cfg.head_dim
        assert cfg.index_head_dim >= cfg.qk_rope_head_dim and cfg.qk_rope_head_dim % 2 == 0
    assert any("hash_moe" in c.mlp_layer_types for c in cfgs) and any("moe" in c.mlp_layer_types for c in cfgs)
    assert any(c.o_groups >= 2 for c in cfgs) and any(c.hc_mult >= 2 for c in cfgs)
    assert all(c.num_nextn_predict_layers == 1 for c in cfgs)


def test_tp_preset_splits_evenly_over_two_ranks():
    cfg = get_preset("tiny-tp")
    for field in ("num_attention_heads", "o_groups", "n_routed_experts", "vocab_size", "index_n_heads"):
        assert getattr(cfg, field) % 2 == 0, f"tiny-tp.{field}={getattr(cfg, field)} is not divisible by TP=2"


def test_presets_are_tiny():
    for name, cfg in _configs().items():
        assert cfg.hidden_size <= 128 and cfg.vocab_size <= 512 and cfg.num_hidden_layers <= 6, name
        assert cfg.n_routed_experts <= 16, name


def test_compressed_layers_use_yarn_and_sliding_layers_plain_rope():
    cfg = get_preset("tiny-mixed")
    assert cfg.rope_parameters["main"]["rope_type"] == "default"
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["factor"] > 1 and compress["attention_factor"] == 1.0
    rotary = build_random_model(cfg).model.rotary_emb
    rd = cfg.qk_rope_head_dim

    def plain(theta):
        return 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)

    # each frequency is one power and one division in fp32 on either side: at most a unit each, elementwise
    ulps = 2
    main, compress, slow = rotary.main_inv_freq, rotary.compress_inv_freq, plain(cfg.compress_rope_theta)
    tolerance = ah.assert_close_ulps(
        main, plain(cfg.rope_theta), dtype=torch.float32, ulps=ulps, name="sliding layers' plain rope_theta"
    )
    ah.assert_effect_exceeds(ah.max_abs(compress - slow), tolerance, factor=10, what="YaRN's change of frequencies")
    bound = slow * (1 + ah.ulp_tolerance(torch.float32, ulps=ulps, scale=1.0))  # relative to each frequency
    assert torch.all(compress <= bound), f"YaRN only slows freqs: {compress.tolist()} vs plain {slow.tolist()}"


def _capture(model, cfg, module_filter):
    """Run a min_seq_len forward and collect (layer, module output) for matching modules."""
    seen = []
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: seen.append((name, args, out)))
        for name, module in model.named_modules()
        if module_filter(name, module)
    ]
    try:
        with torch.no_grad():
            model(_ids(cfg, batch=1))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("preset", [p for p in ALL_PRESETS if CSA in get_preset(p).layer_types])
def test_csa_indexer_really_selects_at_min_seq_len(preset):
    cfg = get_preset(preset)
    model = build_random_model(cfg)
    calls = _capture(model, cfg, lambda n, m: n.endswith("compressor.indexer"))
    assert len(calls) == cfg.layer_types.count(CSA), f"{preset}: indexer ran {len(calls)} times"
    entries = min_seq_len(cfg) // cfg.compress_rates[CSA]
    assert entries > cfg.index_topk, f"{preset}: {entries} CSA entries do not exceed index_topk={cfg.index_topk}"
    for name, _, top in calls:
        last = top[0, -1]
        assert (last >= 0).sum() == cfg.index_topk < entries, f"{name}: last query kept {last.tolist()} of {entries}"


@pytest.mark.parametrize("preset", [p for p in ALL_PRESETS if HCA in get_preset(p).layer_types])
def test_hca_compressor_emits_several_entries_at_min_seq_len(preset):
    cfg = get_preset(preset)
    model = build_random_model(cfg)
    calls = _capture(model, cfg, lambda n, m: n.endswith("self_attn.compressor") and not hasattr(m, "indexer"))
    assert calls, f"{preset}: no HCA compressor ran"
    for name, _, (compressed, _) in calls:
        assert compressed.shape[2] >= 2, f"{name}: HCA emitted {compressed.shape[2]} entries"


def test_hash_layers_route_by_tid2eid_and_score_layers_by_biased_top_k():
    cfg = get_preset("tiny-mixed")
    model = build_random_model(cfg)
    ids = _ids(cfg, batch=1)
    layers = model.model.layers
    for i, kind in enumerate(cfg.mlp_layer_types):
        gate = layers[i].mlp.gate
        x = torch.randn(ids.numel(), cfg.hidden_size, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            if kind == "hash_moe":
                _, _, idx = gate(x, ids)
                assert torch.equal(idx, gate.tid2eid[ids.reshape(-1)]), f"layer {i}: hash routing ignores tid2eid"
            else:
                _, _, idx = gate(x)
                saved = gate.e_score_correction_bias.clone()
                gate.e_score_correction_bias.zero_()
                _, _, unbiased = gate(x)
                gate.e_score_correction_bias.copy_(saved)
                changed = (idx.sort(-1).values != unbiased.sort(-1).values).any(-1).sum()
                assert changed > 0, f"layer {i}: the expert bias never changes the selection"


def test_grouped_output_and_hyper_connection_shapes():
    cfg = get_preset("tiny-mixed")
    sd = build_random_model(cfg).state_dict()
    g, r, h, d, n = cfg.o_groups, cfg.o_lora_rank, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    assert sd["model.layers.0.self_attn.o_a_proj.weight"].shape == (g * r, h * d // g)
    assert sd["model.layers.0.attn_hc.fn"].shape == ((2 + n) * n, n * cfg.hidden_size)


# --- hypothesis: every generated config is valid -----------------------------------------------------


@given(spec=v4_configs())
def test_generated_configs_build_and_run_a_finite_forward(spec):
    cfg = spec.to_config()
    note(f"min_seq_len={min_seq_len(cfg)}")
    model = build_random_model(cfg, seed=0)
    with torch.no_grad():
        logits = model(_ids(cfg, batch=1)).logits
    assert logits.shape == (1, min_seq_len(cfg), cfg.vocab_size)
    assert torch.isfinite(logits).all(), f"non-finite logits for {spec}"
    written = {n: (tuple(t.shape), t.dtype) for n, t in official_state_dict(model, seed=0).items()}
    from tiny_models.manifest import SAFETENSORS_DTYPES

    written = {n: (s, SAFETENSORS_DTYPES[dt]) for n, (s, dt) in written.items()}
    expected = {s.name: (s.shape, s.dtype) for s in manifest(cfg)}
    assert written == expected, f"manifest and written tensors differ: {set(written) ^ set(expected)}"


@given(spec=v4_configs(tp_divisible=2))
def test_tp_divisible_configs_split_evenly_over_two_ranks(spec):
    cfg = spec.to_config()
    for field in ("num_attention_heads", "o_groups", "n_routed_experts", "vocab_size", "index_n_heads"):
        assert getattr(cfg, field) % 2 == 0, f"{field}={getattr(cfg, field)} not divisible by 2"
    assert cfg.num_attention_heads % cfg.o_groups == 0
    assert cfg.qk_rope_head_dim == spec.qk_rope_head_dim, "partial_rotary_factor lost the rope width"
    assert math.gcd(cfg.n_routed_experts, 2) == 2 and cfg.num_experts_per_tok <= cfg.n_routed_experts
