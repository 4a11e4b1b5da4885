"""Coverage: the real Flash and Pro manifests map completely; strays and gaps are named."""

import pytest

from tiny_models.manifest import manifest
from tiny_models.presets import flash_config, get_preset, pro_config

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("make_config", [flash_config, pro_config], ids=["flash", "pro"])
def test_full_size_manifest_has_zero_unmapped_and_zero_missing(impl, make_config):
    names = [s.name for s in manifest(make_config(), with_scales=True)]
    report = impl.coverage_report(names)
    totals = report.totals
    assert totals["unmapped"] == 0 and totals["missing"] == 0, report.table(limit=0)
    scales = sum(n.endswith(".scale") for n in names)
    assert totals["declared_not_loaded"] == scales and totals["mapped"] == len(names) - scales, totals


def test_stray_and_missing_tensors_are_named(impl):
    names = [s.name for s in manifest(get_preset("tiny-mixed"))]
    names.remove("layers.1.ffn.experts.0.w3.weight")
    names.append("layers.0.attn.wq_c.weight")
    report = impl.coverage_report(names)
    assert report.unmapped == ["layers.0.attn.wq_c.weight"], report.table(limit=0)
    assert report.missing == ["layers.1.ffn.experts.0.w3.weight"], report.table(limit=0)


@pytest.mark.parametrize("make_config", [flash_config, pro_config], ids=["flash", "pro"])
def test_full_size_manifest_is_complete_in_the_upstream_layout_too(impl, make_config):
    names = [s.name for s in manifest(make_config(), with_scales=True)]
    report = impl.coverage_report(names, layout="upstream")
    totals = report.totals
    assert totals["unmapped"] == 0 and totals["missing"] == 0, report.table(limit=0)
    by_name = {e.official: e.native for e in report.entries}
    assert by_name["layers.3.attn.wo_a.weight"] == "decoder.layers.3.self_attention.linear_o_group_proj"
    assert by_name["layers.3.ffn.experts.9.w1.weight"] == "decoder.layers.3.mlp.experts.linear_fc1.weight9"


def test_an_unknown_layout_is_a_typed_error_naming_the_choices(impl):
    with pytest.raises(impl.UnsupportedConfigError, match="'miles', 'upstream'"):
        impl.coverage_report(["embed.weight"], layout="megatron")
