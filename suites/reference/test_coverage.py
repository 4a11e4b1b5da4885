"""Coverage: the real Flash and Pro manifests map completely; strays and gaps are named.

"Missing" is judged against the config (every name a checkpoint of that config must hold), and the expected set is
the manifest ``tiny_models`` derives from the config alone, independently of the implementation's table."""

import re

import pytest

from tiny_models.manifest import manifest
from tiny_models.presets import flash_config, get_preset, pro_config

pytestmark = pytest.mark.cpu

FULL_SIZE = {"flash": flash_config, "pro": pro_config}


@pytest.fixture(scope="module", params=sorted(FULL_SIZE))
def full_size(request):
    """(variant, config, every tensor name of its quantized checkpoint, the weights among them: no ``.scale``)."""
    config = FULL_SIZE[request.param]()
    names = [s.name for s in manifest(config, with_scales=True)]
    return request.param, config, names, [n for n in names if not n.endswith(".scale")]


def _family(name: str) -> str:
    """A tensor's name with its layer / expert / MTP indices wildcarded."""
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def test_full_size_manifest_has_zero_unmapped_and_zero_missing(impl, full_size):
    variant, config, names, weights = full_size
    report = impl.coverage_report(names, config=config)
    totals = report.totals
    assert totals["unmapped"] == 0 and totals["missing"] == 0, f"{variant}:\n{report.table(limit=0)}"
    scales = len(names) - len(weights)
    assert totals["declared_not_loaded"] == scales and totals["mapped"] == len(weights), f"{variant}: {totals}"
    expected = set(impl.coverage_report([], config=config).missing)
    assert expected == set(weights), (
        f"{variant}: names the config implies but the manifest lacks: {sorted(expected - set(weights))[:10]}; "
        f"manifest weights the config does not imply: {sorted(set(weights) - expected)[:10]}"
    )


def test_a_full_size_checkpoint_missing_one_tensor_of_each_family_names_each_missing(impl, full_size):
    """The gap a partner or family check cannot infer (a compressor, indexer, hc_head, MTP tensor...) is named too."""
    variant, config, names, weights = full_size
    dropped = sorted({_family(n): n for n in weights}.values())  # one per family: the last layer's or expert's
    report = impl.coverage_report(sorted(set(names) - set(dropped)), config=config)
    assert sorted(report.missing) == dropped, (
        f"{variant}: absent but not reported missing: {sorted(set(dropped) - set(report.missing))}; "
        f"reported missing but present: {sorted(set(report.missing) - set(dropped))}"
    )


def test_stray_and_missing_tensors_are_named(impl):
    names = [s.name for s in manifest(get_preset("tiny-mixed"))]
    names.remove("layers.1.ffn.experts.0.w3.weight")
    names.append("layers.0.attn.wq_c.weight")
    report = impl.coverage_report(names)
    assert report.unmapped == ["layers.0.attn.wq_c.weight"], report.table(limit=0)
    assert report.missing == ["layers.1.ffn.experts.0.w3.weight"], report.table(limit=0)


def test_full_size_manifest_is_complete_in_the_upstream_layout_too(impl, full_size):
    variant, config, names, _ = full_size
    report = impl.coverage_report(names, config=config, layout="upstream")
    totals = report.totals
    assert totals["unmapped"] == 0 and totals["missing"] == 0, f"{variant}:\n{report.table(limit=0)}"
    by_name = {e.official: e.native for e in report.entries}
    assert by_name["layers.3.attn.wo_a.weight"] == "decoder.layers.3.self_attention.linear_o_group_proj"
    assert by_name["layers.3.ffn.experts.9.w1.weight"] == "decoder.layers.3.mlp.experts.linear_fc1.weight9"


def test_the_miles_layout_named_at_run_time_gives_each_official_tensor_its_one_miles_name(impl):
    """The layout a user names (``coverage --layout miles``) is a string built at run time, equal to but not the same
    object as any literal; the upstream layout splits a hyper-connection scale over three parameters, Miles does not."""
    layout = "".join(["mil", "es"])  # as argparse hands --layout over
    names = [s.name for s in manifest(get_preset("tiny-mixed"))]
    by_name = {e.official: e.native for e in impl.coverage_report(names, layout=layout).entries}
    for scale in ("hc_attn_scale", "hc_ffn_scale"):
        assert by_name[f"layers.1.{scale}"] == f"decoder.layers.1.{scale}", by_name[f"layers.1.{scale}"]


def test_an_unknown_layout_is_a_typed_error_naming_the_choices(impl):
    with pytest.raises(impl.UnsupportedConfigError, match="'miles', 'upstream'"):
        impl.coverage_report(["embed.weight"], layout="megatron")


@pytest.mark.parametrize("variant", [*sorted(FULL_SIZE), "tiny-mixed", "tiny-sliding"])
def test_a_published_config_json_implies_exactly_its_manifest(impl, variant):
    """DeepSeek's published ``config.json`` (``compress_ratios`` with the MTP entry, ``num_hash_layers``) states the
    schedule outright; what it implies is the manifest ``tiny_models`` derives from the same configuration."""
    from fixtures.data.sparse_checkpoint import published_config

    config = FULL_SIZE[variant]() if variant in FULL_SIZE else get_preset(variant)
    weights = {s.name for s in manifest(config, with_scales=False)}
    implied = set(impl.coverage_report([], config=published_config(config)).missing)
    assert implied == weights, (
        f"{variant}: implied, not in the manifest: {sorted(implied - weights)[:5]}; "
        f"in the manifest, not implied: {sorted(weights - implied)[:5]}"
    )


def test_a_published_config_json_without_mtp_layers_implies_its_manifest_without_mtp_tensors(impl):
    """A base published without MTP layers leaves ``num_nextn_predict_layers`` out: it still states the schedule
    outright, and implies no ``mtp.*`` tensor."""
    from fixtures.data.sparse_checkpoint import published_config

    config = get_preset("tiny-mixed")
    published = published_config(config)
    del published["num_nextn_predict_layers"]
    weights = {s.name for s in manifest(config, with_scales=False) if not s.name.startswith("mtp.")}
    implied = set(impl.coverage_report([], config=published).missing)
    assert implied == weights, (
        f"implied, not in the manifest: {sorted(implied - weights)[:5]}; "
        f"in the manifest, not implied: {sorted(weights - implied)[:5]}"
    )


def test_the_native_config_a_model_is_built_from_implies_exactly_its_manifest(impl):
    """Coverage takes the native ``V4Config`` too (what a caller already built its model from), as it is."""
    config = get_preset("tiny-mixed")
    weights = {s.name for s in manifest(config, with_scales=False)}
    implied = set(impl.coverage_report([], config=impl.V4Config.from_hf(config)).missing)
    assert implied == weights, (
        f"implied, not in the manifest: {sorted(implied - weights)[:5]}; "
        f"in the manifest, not implied: {sorted(weights - implied)[:5]}"
    )


def test_a_transformers_form_config_json_implies_exactly_its_manifest(impl):
    """A ``config.json`` written by transformers states the schedule as ``layer_types`` / ``mlp_layer_types``, not
    DeepSeek's published keys: it is folded through transformers, and implies the same manifest."""
    config = get_preset("tiny-mixed")
    weights = {s.name for s in manifest(config, with_scales=False)}
    implied = set(impl.coverage_report([], config=config.to_dict()).missing)
    assert implied == weights, (
        f"implied, not in the manifest: {sorted(implied - weights)[:5]}; "
        f"in the manifest, not implied: {sorted(weights - implied)[:5]}"
    )


def test_a_config_json_transformers_cannot_build_is_refused_naming_what_is_wrong(impl):
    """A transformers-form config whose layer count disagrees with its layer schedule is a typed error that quotes
    transformers' own objection, never a bare exception from inside it."""
    config = get_preset("tiny-mixed").to_dict()
    config["num_hidden_layers"] = len(config["layer_types"]) + 5
    with pytest.raises(impl.UnsupportedConfigError, match="num_hidden_layers"):
        impl.coverage_report([], config=config)


def test_coverage_of_a_base_with_a_published_config_never_imports_transformers(impl, tmp_path):
    """Importing transformers costs seconds and most of the memory of a full-size coverage run; a published config
    needs no folding."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from fixtures.data.sparse_checkpoint import published_config
    from fixtures.runner.subproc import cli_imports

    (tmp_path / "config.json").write_text(json.dumps(published_config(flash_config())))
    save_file({"embed.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    _, imported, out = cli_imports(impl.name, ["coverage", "--base", tmp_path], "transformers")
    assert not imported and "missing" in out, out[-4000:]
