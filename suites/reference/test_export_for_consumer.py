"""Exporting for a consumer fails closed when the consumer would not apply a target.

An export for vLLM 0.33 or 0.34 / SGLang 0.5.23 / PEFT (``consumer=``, a release named as ``vllm==0.34.0`` or
``consumer_version``; default: the newest release a lane tested) that the consumer would silently not apply, skip or
misroute raises a typed error naming consumer, version, target and why, through the export protocol's fail-closed
path: nothing is published, no ``.complete``, an earlier export at the destination untouched. The expected
verdicts are each release's own (its code, read by ``suites/reference/test_consumers.py``: 0.33's o-projection hands
``wo_a``'s weight to ``deep_gemm_fp8_o_proj``, 0.34's NVIDIA one calls its LoRA class's ``grouped_forward`` while
its XPU one still reads the weight; ``lora_skip_prefixes`` drops ``mtp.``; the loader refuses transformers' leaf
names; SGLang's V4 model has no LoRA hooks). ``allow_unapplied=True`` exports anyway and records those targets in
the safetensors metadata ``dsv4_consumer``.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter, snapshot_tree
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

R, ALPHA = 4, 8.0
VLLM, VLLM_NEWEST, SGLANG = "0.33.0", "0.34.0", "0.5.23"
ALL = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")


def _state(impl, targets=ALL, *, mtp=False):
    cfg = get_preset("tiny-mixed")
    shapes = config_attention_shapes(cfg)
    chosen = {t: shapes[t] for t in targets}
    return impl.AdapterState(make_native_adapter(chosen, cfg.num_hidden_layers, R, mtp=mtp), r=R, alpha=ALPHA)


@pytest.fixture
def earlier(impl, tmp_path):
    """A destination holding an earlier, valid export (which a refused export must leave exactly as it was)."""
    out = tmp_path / "deploy" / "adapter"
    impl.export_adapter(_state(impl, ("wq_a",)), out, dialect="official")
    return out


def _refused(impl, out, state, **kwargs) -> str:
    """Export for a consumer; assert it failed closed with the typed cause and the tree untouched; the message."""
    before = snapshot_tree(out)
    with pytest.raises(impl.CollectiveExportError) as info:
        impl.export_adapter(state, out, **kwargs)
    cause = info.value.__cause__
    assert isinstance(cause, impl.ConsumerSupportError), f"cause {type(cause).__name__}: {cause}"
    assert "phase serialize" in str(info.value), f"not refused before anything was written: {info.value}"
    assert snapshot_tree(out) == before, f"{out}: a refused export changed the destination or its surroundings"
    with pytest.raises(impl.ConsumerSupportError):  # the in-memory publication refuses the same way
        impl.publish_in_memory(state, **kwargs)
    return str(cause)


def test_wo_a_for_vllm_fails_closed_naming_the_kernel_that_reads_its_weight(impl, earlier):
    message = _refused(impl, earlier, _state(impl), dialect="official", consumer="vllm", consumer_version=VLLM)
    for platform in ("vllm/nvidia", "vllm/xpu"):
        assert f"{platform} {VLLM} (official dialect): wo_a: loaded_not_applied" in message, message
    assert "deep_gemm_fp8_o_proj" in message and "DeepseekV4XPUAttention._o_proj" in message, message
    for applied in ("wq_a", "wq_b", "wkv", "wo_b"):
        assert f": {applied}:" not in message, f"{applied} is applied by vLLM, yet named: {message}"


def test_vllm_0_34_applies_wo_a_on_nvidia_so_only_xpu_refuses_it(impl, earlier, tmp_path):
    """0.34's NVIDIA model applies wo_a (DeepseekV4GroupedWoAWithLoRA), its XPU model still does not: an export of
    all five targets for vllm==0.34.0 (both LoRA platforms) names only XPU's wo_a; for vllm/nvidia it exports."""
    message = _refused(impl, earlier, _state(impl), dialect="official", consumer=f"vllm=={VLLM_NEWEST}")
    assert f"vllm/xpu {VLLM_NEWEST} (official dialect): wo_a: loaded_not_applied" in message, message
    assert f"vllm/nvidia {VLLM_NEWEST} (official dialect)" not in message, (
        f"vLLM {VLLM_NEWEST} applies wo_a on NVIDIA, yet named as a problem: {message}"
    )
    assert f"vllm/nvidia {VLLM_NEWEST} applies every target" in message, f"the way forward is not named: {message}"
    out = tmp_path / "for-nvidia"
    impl.export_adapter(_state(impl), out, dialect="official", consumer=f"vllm/nvidia=={VLLM_NEWEST}")
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        record = json.loads((f.metadata() or {})["dsv4_consumer"])
    assert (record["version"], record["unapplied"]) == (VLLM_NEWEST, []), record


@pytest.mark.parametrize("release", [VLLM, VLLM_NEWEST])
def test_mtp_targets_for_vllm_fail_closed_naming_its_skip_prefix(impl, earlier, release):
    state = _state(impl, ("wq_a", "wkv"), mtp=True)
    message = _refused(impl, earlier, state, dialect="official", consumer=f"vllm=={release}")
    assert f"vllm/nvidia {release} (official dialect): mtp: skipped" in message, message
    assert "lora_skip_prefixes" in message, message


@pytest.mark.parametrize("release", [VLLM, VLLM_NEWEST])
def test_the_transformers_dialect_for_vllm_fails_closed(impl, earlier, release):
    state = _state(impl, ("wq_a",))
    message = _refused(impl, earlier, state, dialect="transformers", consumer="vllm", consumer_version=release)
    assert f"vllm/nvidia {release} (transformers dialect): (adapter): rejected" in message, message
    assert f"vllm/nvidia {release} (transformers dialect): wq_a: rejected" in message, message
    assert "LoRAModel.from_local_checkpoint" in message, message


@pytest.mark.parametrize("dialect", ["official", "sglang"])
@pytest.mark.parametrize("target", ALL)
def test_any_v4_adapter_for_sglang_fails_closed(impl, earlier, target, dialect):
    message = _refused(impl, earlier, _state(impl, (target,)), dialect=dialect, consumer="sglang")
    assert f"sglang {SGLANG} ({dialect} dialect): {target}: rejected" in message, message
    if target == "wq_b":
        assert "-> indexer.wq_b" in message and "get_normalized_target_modules" in message, message


def test_opting_in_exports_and_records_what_vllm_will_not_apply(impl, tmp_path):
    out = tmp_path / "adapter"
    state = _state(impl, mtp=True)
    impl.export_adapter(state, out, dialect="official", consumer="vllm", consumer_version=VLLM, allow_unapplied=True)
    assert (out / impl.COMPLETE_MARKER).is_file(), "the opted-in export was not certified"
    impl.validate_adapter_dir(out)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        record = json.loads((f.metadata() or {})["dsv4_consumer"])
    assert (record["consumer"], record["version"], record["dialect"]) == ("vllm", VLLM, "official"), record
    unapplied = {(u["engine"], u["target"]): u for u in record["unapplied"]}
    assert set(unapplied) == {(p, t) for p in ("vllm/nvidia", "vllm/xpu") for t in ("wo_a", "mtp")}, unapplied
    assert unapplied["vllm/nvidia", "wo_a"]["status"] == "loaded_not_applied"
    assert "deep_gemm_fp8_o_proj" in unapplied["vllm/nvidia", "wo_a"]["why"]
    assert unapplied["vllm/nvidia", "mtp"]["status"] == "skipped"
    config = json.loads((out / "adapter_config.json").read_text())
    assert not any(k.startswith("dsv4") for k in config), "the record belongs in the safetensors metadata only"


@pytest.mark.parametrize(
    "consumer, dialect, targets",
    [("vllm", "official", ("wq_a", "wq_b", "wkv", "wo_b")), ("peft", "transformers", ALL)],
)
def test_an_adapter_the_consumer_applies_exports_with_an_empty_record(impl, tmp_path, consumer, dialect, targets):
    out = tmp_path / "adapter"
    impl.export_adapter(_state(impl, targets), out, dialect=dialect, consumer=consumer)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        record = json.loads((f.metadata() or {})["dsv4_consumer"])
    assert record["unapplied"] == [] and record["unknown"] == [], record


def test_an_unknown_consumer_or_a_release_no_lane_ran_is_refused(impl):
    state = _state(impl, ("wq_a",))
    with pytest.raises(impl.ConsumerSupportError, match=r"'tgi'.*known consumers"):
        impl.publish_in_memory(state, dialect="official", consumer="tgi")
    tested = r"no lane tested that release.*\['0\.33\.0', '0\.34\.0'\]"
    with pytest.raises(impl.ConsumerSupportError, match=r"'0\.35\.0': " + tested):
        impl.publish_in_memory(state, dialect="official", consumer="vllm", consumer_version="0.35.0")
    with pytest.raises(impl.ConsumerSupportError, match=r"'0\.32\.0': " + tested):
        impl.publish_in_memory(state, dialect="official", consumer="vllm==0.32.0")
    with pytest.raises(impl.ConsumerSupportError, match="name different releases"):
        impl.publish_in_memory(state, dialect="official", consumer="vllm==0.33.0", consumer_version="0.34.0")


def test_the_default_release_is_the_newest_a_lane_tested(impl):
    verdict = impl.consumer_verdict("vllm", "official", ["wq_a"])
    assert (verdict.version, verdict.defaulted, verdict.tested) == (VLLM_NEWEST, True, (VLLM, VLLM_NEWEST)), verdict
    assert f"vllm {VLLM_NEWEST} (the newest tested release" in verdict.release_note(), verdict.release_note()
    named = impl.consumer_verdict(f"vllm=={VLLM}", "official", ["wq_a"])
    assert (named.version, named.defaulted) == (VLLM, False), named
