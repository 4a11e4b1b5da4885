"""A portable V4 adapter is a PEFT directory that real peft loads onto transformers' DeepseekV4ForCausalLM,
wrapping exactly the exported modules and reproducing W + (alpha/r) * B @ A."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import fixtures.asserts as ah
from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter

pytestmark = pytest.mark.cpu

R, ALPHA = 4, 8.0
PLAIN = ("wq_a", "wq_b", "wkv", "wo_b")
#: PEFT's forward (unmerged, or merged by PEFT) vs the hand-merged ``W + (alpha/r) B@A`` reference: one fp32
#: transformers forward each, differing only in how the adapter is summed and rounded into the weights, so by
#: rounding relative to the logits' scale; in units of eps(float32) * max|reference logits|, qualify's float32
#: figure for the same reload comparison.
LOGIT_ULPS = 256
HF_LEAF = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}


@pytest.fixture(scope="module")
def api(impl):
    return impl


@pytest.fixture(scope="module")
def tiny():
    from transformers import DeepseekV4ForCausalLM

    from tiny_models.presets import get_preset, min_seq_len

    cfg = get_preset("tiny-mixed")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval().float()
    ids = torch.randint(0, cfg.vocab_size, (1, min_seq_len(cfg)), generator=torch.Generator().manual_seed(1))
    return cfg, model, ids


def _shapes(cfg):
    return config_attention_shapes(cfg)


def _native(cfg, leaves, seed=0):
    shapes = {k: v for k, v in _shapes(cfg).items() if k in leaves}
    return make_native_adapter(shapes, cfg.num_hidden_layers, R, seed=seed, b_scale=0.5)


def _merged_reference(model, native):
    """The oracle: a copy of the model whose targeted weights are W + (alpha/r) B @ A (fp32)."""
    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    for name, a in native.items():
        if not name.endswith("linear_in.weight"):
            continue
        b = native[name.replace("linear_in", "linear_out")]
        parts = name.split(".")
        layer, leaf = int(parts[2]), parts[4]
        sd[f"model.layers.{layer}.self_attn.{HF_LEAF[leaf]}.weight"] += (ALPHA / R) * (b.float() @ a.float())
    ref.load_state_dict(sd)
    return ref


def _export(api, tmp_path, native, **kw):
    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(native, r=R, alpha=ALPHA, dropout=0.05), out, **kw)
    return out


def _lora_wrapped(peft_model) -> set[str]:
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {n.removeprefix(prefix) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}


def test_adapter_config_has_the_peft_lora_fields(api, tiny, tmp_path) -> None:
    cfg, _, _ = tiny
    out = _export(api, tmp_path, _native(cfg, PLAIN), base_model_name_or_path="deepseek-ai/DeepSeek-V4-Flash")
    config = json.loads((out / "adapter_config.json").read_text())
    want = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.05, "bias": "none"}
    assert {k: config[k] for k in want} == want, config
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == "deepseek-ai/DeepSeek-V4-Flash"
    assert (out / "adapter_model.safetensors").read_bytes()[:8] != b"PK\x03\x04", "pickle/zip, not safetensors"
    assert sorted(p.name for p in out.iterdir()) == [".complete", "adapter_config.json", "adapter_model.safetensors"]


def test_peft_wraps_exactly_the_exported_modules_not_the_indexer_or_compressor(api, tiny, tmp_path) -> None:
    from peft import PeftModel

    cfg, model, _ = tiny
    native = {k: v for k, v in _native(cfg, PLAIN).items() if ".layers.0." not in k or ".wkv." not in k}
    out = _export(api, tmp_path, native)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(out))
    exported = {
        k.removeprefix("base_model.model.").rsplit(".", 2)[0]
        for k in __import__("safetensors.torch").torch.load_file(str(out / "adapter_model.safetensors"))
    }
    wrapped = _lora_wrapped(peft_model)
    assert wrapped == exported, (
        f"wrapped but not exported: {sorted(wrapped - exported)}; missing: {sorted(exported - wrapped)}"
    )
    assert "model.layers.0.self_attn.kv_proj" not in wrapped, "layer 0 kv_proj has no adapter but was wrapped"
    decoys = [n for n, _ in model.named_modules() if n.endswith(("compressor.kv_proj", "indexer.q_b_proj"))]
    assert decoys, "the tiny preset must have compressor/indexer projections for this test to mean anything"


def _assert_logits_match_reference(cfg, got, want, base, *, targets, name: str) -> None:
    """``got`` equals the reference ``want`` within ``LOGIT_ULPS``; first, the adapter's effect ``want - base``
    shared over its (target, layer) pairs, the smallest effect claimed, must exceed that tolerance."""
    __tracebackhide__ = True
    tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=ah.max_abs(want))
    pairs = len(targets) * cfg.num_hidden_layers
    ah.assert_effect_exceeds(
        ah.max_abs(want - base), tolerance, factor=pairs, what=f"{name}: the adapter per (target, layer)"
    )
    ah.assert_close_ulps(got, want, dtype=torch.float32, ulps=LOGIT_ULPS, name=name)


def test_plain_targets_change_logits_exactly_as_w_plus_scaled_ba(api, tiny, tmp_path) -> None:
    from peft import PeftModel

    cfg, model, ids = tiny
    native = _native(cfg, PLAIN, seed=3)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(_export(api, tmp_path, native))).eval()
    with torch.no_grad():
        base, got, want = model(ids).logits, peft_model(ids).logits, _merged_reference(model, native)(ids).logits
    _assert_logits_match_reference(cfg, got, want, base, targets=PLAIN, name="unmerged PEFT logits vs W + s B@A")


def test_grouped_o_a_proj_adapter_merges_to_the_oracle(api, tiny, tmp_path) -> None:
    """PEFT's unmerged forward is wrong for the grouped o_a_proj, so the adapter is checked via merge_and_unload."""
    from peft import PeftModel

    cfg, model, ids = tiny
    native = _native(cfg, tuple(HF_LEAF), seed=4)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(_export(api, tmp_path, native)))
    merged = peft_model.merge_and_unload().eval()
    with torch.no_grad():
        got, want, base = merged(ids).logits, _merged_reference(model, native)(ids).logits, model(ids).logits
    _assert_logits_match_reference(cfg, got, want, base, targets=HF_LEAF, name="merged o_a_proj adapter vs oracle")


def test_in_memory_publication_equals_the_file_export(api, tiny, tmp_path) -> None:
    from safetensors.torch import load_file

    cfg, _, _ = tiny
    native = _native(cfg, tuple(HF_LEAF), seed=5)
    state = api.AdapterState(native, r=R, alpha=ALPHA)
    tensors, config = api.publish_in_memory(state, base_model_name_or_path="b")
    out = tmp_path / "adapter"
    api.export_adapter(state, out, base_model_name_or_path="b")
    on_disk = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(on_disk)
    for k, v in tensors.items():
        assert torch.equal(v, on_disk[k]) and v.dtype == on_disk[k].dtype, f"{k} differs between memory and file"
    assert config == json.loads((out / "adapter_config.json").read_text())


@pytest.mark.parametrize(
    "dialect,a_name",
    [
        ("transformers", "base_model.model.model.layers.1.self_attn.q_b_proj.lora_A.weight"),
        ("official", "base_model.model.layers.1.attn.wq_b.lora_A.weight"),
        ("sglang", "base_model.model.model.layers.1.self_attn.wq_b.lora_A.weight"),
    ],
)
def test_each_dialect_names_the_adapter_its_consumer_expects(api, tiny, dialect, a_name) -> None:
    cfg, _, _ = tiny
    native = _native(cfg, PLAIN)
    tensors, config = api.publish_in_memory(api.AdapterState(native, r=R, alpha=ALPHA), dialect=dialect)
    assert a_name in tensors, f"{dialect}: {sorted(tensors)[:3]}"
    src = native["decoder.layers.1.self_attention.wq_b.adapter.linear_in.weight"]
    assert torch.equal(tensors[a_name], src)
    assert len(tensors) == len(native)
    # what its consumer matches target_modules against: vLLM and SGLang compare module leaves with a list, PEFT
    # fullmatches one regex over transformers' module paths
    modules = config["target_modules"]
    if dialect == "transformers":
        assert isinstance(modules, str) and "q_b_proj" in modules, f"{dialect}: target_modules {modules!r}"
    else:
        assert isinstance(modules, list) and "wq_b" in modules, f"{dialect}: target_modules {modules!r}, not leaves"


def test_mtp_adapters_are_rejected_for_transformers_unless_excluded_and_kept_for_official(api, tiny) -> None:
    cfg, _, _ = tiny
    shapes = {k: v for k, v in _shapes(cfg).items() if k in PLAIN}
    native = make_native_adapter(shapes, cfg.num_hidden_layers, R, mtp=True)
    state = api.AdapterState(native, r=R, alpha=ALPHA)
    with pytest.raises(api.ExportError, match=r"mtp\.layers\.0\.mtp_model_layer\.self_attention\..*no MTP"):
        api.publish_in_memory(state)
    tensors, _ = api.publish_in_memory(state, mtp="exclude")
    assert not any("mtp" in k for k in tensors) and len(tensors) == len(native) - 2 * len(PLAIN)
    official, _ = api.publish_in_memory(state, dialect="official")
    assert "base_model.model.mtp.0.attn.wq_a.lora_B.weight" in official


def test_a_state_declaring_its_targets_in_every_layer_is_published(api, tiny) -> None:
    """What the gather hands over when every rank held every target: ``targets`` and ``num_layers`` declared, every
    declared target present in every layer. The check that each layer has them must find them, not refuse."""
    cfg, _, _ = tiny
    native = _native(cfg, PLAIN)
    state = api.AdapterState(native, r=R, alpha=ALPHA, targets=list(PLAIN), num_layers=cfg.num_hidden_layers)
    tensors, _ = api.publish_in_memory(state)
    assert len(tensors) == len(native) == 2 * len(PLAIN) * cfg.num_hidden_layers, sorted(tensors)[:4]


def test_published_modules_come_in_model_order_with_mtp_last(api, tiny) -> None:
    """The published tensors (what a rollout weight sync streams) come module by module in model order: decoder
    layers ascending, then the MTP layer."""
    cfg, _, _ = tiny
    shapes = {k: v for k, v in _shapes(cfg).items() if k in PLAIN}
    native = make_native_adapter(shapes, cfg.num_hidden_layers, R, mtp=True)
    tensors, _ = api.publish_in_memory(api.AdapterState(native, r=R, alpha=ALPHA), dialect="official")
    scopes = [".".join(k.removeprefix("base_model.model.").split(".")[:2]) for k in tensors]
    want = [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp.0"]
    assert list(dict.fromkeys(scopes)) == want, f"published in the order {list(dict.fromkeys(scopes))}"


def test_fingerprint_detects_a_different_base(api, tiny, tmp_path) -> None:
    cfg, model, _ = tiny
    base = {k: v.clone() for k, v in model.state_dict().items()}
    native = _native(cfg, PLAIN)
    names = sorted({f"layers.{k.split('.')[2]}.attn.{k.split('.')[4]}.weight" for k in native})
    fp = api.base_fingerprint(base, names, config=cfg.to_dict())
    out = _export(api, tmp_path, native, base_fingerprint=fp)
    api.verify_fingerprint(out, base, config=cfg.to_dict())  # same base: passes
    other = dict(base)
    other["model.layers.2.self_attn.kv_proj.weight"] = base["model.layers.2.self_attn.kv_proj.weight"] + 1e-3
    with pytest.raises(api.FingerprintMismatchError, match=r"layers\.2\.attn\.wkv\.weight: sha256"):
        api.verify_fingerprint(out, other, config=cfg.to_dict())
    changed_cfg = {**cfg.to_dict(), "rms_norm_eps": 1e-5}
    with pytest.raises(api.FingerprintMismatchError, match="config.json"):
        api.verify_fingerprint(out, base, config=changed_cfg)


def test_fingerprint_of_a_checkpoint_dir_reads_only_the_targeted_shards(api, tiny, tmp_path) -> None:
    """The index names a shard of non-targeted tensors that does not exist: only target shards may be opened."""
    from safetensors.torch import save_file

    cfg, model, _ = tiny
    sd = model.state_dict()
    attn = {f"layers.{i}.attn.wq_a.weight": sd[f"model.layers.{i}.self_attn.q_a_proj.weight"] for i in range(2)}
    save_file(attn, str(tmp_path / "model-00001.safetensors"))
    weight_map = {k: "model-00001.safetensors" for k in attn} | {"layers.0.ffn.gate.weight": "model-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    from_dir = api.base_fingerprint(tmp_path, sorted(attn))
    from_state = api.base_fingerprint(dict(sd), sorted(attn), config=json.loads((tmp_path / "config.json").read_text()))
    assert from_dir == from_state, "checkpoint-dir and in-memory fingerprints of the same base differ"


def test_the_marker_certifies_the_published_bytes_and_the_same_adapter_gives_the_same_bytes(
    api, tiny, tmp_path
) -> None:
    """``.complete`` names every published file with the sha256 of its bytes (hashlib over the file, not the
    exporter's own figure), and exporting the same adapter twice publishes the same bytes (a pinned adapter can be
    certified by its hash)."""
    import hashlib

    cfg, _, _ = tiny
    native = _native(cfg, HF_LEAF)
    first, second = (_export(api, tmp_path / name, native) for name in ("one", "two"))
    marker = json.loads((first / api.COMPLETE_MARKER).read_text())
    published = {p.name for p in first.iterdir() if p.name != api.COMPLETE_MARKER}
    assert set(marker["files"]) == published, f"the marker names {sorted(marker['files'])}, published {published}"
    for name, digest in marker["files"].items():
        actual = hashlib.sha256((first / name).read_bytes()).hexdigest()
        assert digest == actual, f"{name}: the marker certifies sha256 {digest[:12]}…, the file has {actual[:12]}…"
    for name in published:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between two exports"


def test_validate_adapter_dir_accepts_the_export_and_names_a_tampered_file(api, tiny, tmp_path) -> None:
    cfg, _, _ = tiny
    out = _export(api, tmp_path, _native(cfg, PLAIN))
    report = api.validate_adapter_dir(out)
    assert len(report["modules"]) == len(PLAIN) * cfg.num_hidden_layers
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "r": R + 1}))
    with pytest.raises(api.ExportError, match="adapter_config.json"):
        api.validate_adapter_dir(out)


def test_stock_peft_cannot_run_the_grouped_o_a_proj_unmerged(api, tiny, tmp_path) -> None:
    """Why load_peft_adapter exists: PEFT's dense LoRA forward adds [.., G, G*R] to o_a_proj's [.., G, R] output."""
    from peft import PeftModel

    cfg, model, ids = tiny
    native = _native(cfg, ("wo_a",), seed=5)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(_export(api, tmp_path, native))).eval()
    assert cfg.o_groups > 1, "the preset must have several output groups for this test to mean anything"
    with (
        pytest.raises(RuntimeError, match=r"size of tensor a \(\d+\) must match the size of tensor b"),
        torch.no_grad(),
    ):
        peft_model(ids)


@pytest.mark.parametrize("leaves", [("wo_a",), tuple(HF_LEAF)], ids=["o_a_proj-only", "five-targets"])
def test_grouped_o_a_proj_runs_unmerged_through_the_grouped_peft_layer(api, tiny, tmp_path, leaves) -> None:
    """impl.load_peft_adapter registers GroupedLoraLinear: unmerged logits == W + (alpha/r) B@A oracle, the adapter
    can be disabled back to the base, and merging gives the same logits."""
    cfg, model, ids = tiny
    native = _native(cfg, leaves, seed=6)
    out = _export(api, tmp_path, native)
    peft_model = api.load_peft_adapter(copy.deepcopy(model), out).eval()
    grouped = [n for n, m in peft_model.named_modules() if isinstance(m, api.GroupedLoraLinear)]
    assert len(grouped) == cfg.num_hidden_layers, f"GroupedLoraLinear wraps {grouped}"
    with torch.no_grad():
        got, want, base = peft_model(ids).logits, _merged_reference(model, native)(ids).logits, model(ids).logits
        with peft_model.disable_adapter():
            disabled = peft_model(ids).logits
        merged = api.load_peft_adapter(copy.deepcopy(model), out, merge=True).eval()(ids).logits
    _assert_logits_match_reference(cfg, got, want, base, targets=leaves, name=f"{leaves}: unmerged grouped PEFT")
    torch.testing.assert_close(disabled, base, rtol=0, atol=0, msg="disabled adapter != base")
    _assert_logits_match_reference(cfg, merged, want, base, targets=leaves, name=f"{leaves}: merged")
