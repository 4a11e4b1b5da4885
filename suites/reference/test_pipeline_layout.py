"""Pipeline layouts: generated when absent, reused on load and export, impossible ones rejected."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu

FULL_SIZE = {"flash": (43, 3), "pro": (61, 3)}


def _check_layout(layout, *, num_layers, stages, num_hash_layers, mtp_layers):
    assert len(layout) == stages, f"{len(layout)} stages, expected {stages}"
    assert layout[0][0] == "embedding", f"stage 0 starts with {layout[0][0]}"
    assert layout[-1][-1] == "loss"
    assert [t for st in layout for t in st].count("decoder") == num_layers
    assert layout[0].count("decoder") >= num_hash_layers, f"hash layers off stage 0: {layout[0]}"
    assert all("mtp" not in st for st in layout[:-1]) and layout[-1].count("mtp") == mtp_layers
    counts = [st.count("decoder") for st in layout]
    if layout[0].count("decoder") == num_hash_layers and num_hash_layers > -(-num_layers // stages):
        counts = counts[1:]  # stage 0 forced up by hash layers; the rest stay balanced
    assert max(counts) - min(counts) <= 1, f"decoders unbalanced: {counts}"


@pytest.mark.parametrize("model", sorted(FULL_SIZE))
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_full_size_layouts_are_balanced_with_hash_layers_first(impl, model, pp):
    layers, hash_layers = FULL_SIZE[model]
    layout = impl.generate_pipeline_layout(layers, pp, num_hash_layers=hash_layers, mtp_layers=1)
    _check_layout(layout, num_layers=layers, stages=pp, num_hash_layers=hash_layers, mtp_layers=1)


@pytest.mark.parametrize(("layers", "pp", "hash_layers"), [(4, 2, 1), (4, 4, 1), (3, 2, 2), (6, 3, 4)])
def test_tiny_layouts_keep_every_stage_non_empty(impl, layers, pp, hash_layers):
    layout = impl.generate_pipeline_layout(layers, pp, num_hash_layers=hash_layers, mtp_layers=1)
    _check_layout(layout, num_layers=layers, stages=pp, num_hash_layers=hash_layers, mtp_layers=1)
    assert all("decoder" in st for st in layout)


def test_more_stages_than_layers_is_rejected(impl):
    with pytest.raises(impl.PipelineLayoutError, match="5 pipeline stages for 4 decoder layers"):
        impl.generate_pipeline_layout(4, 5)


def test_hash_layers_that_cannot_sit_on_stage_zero_are_rejected(impl):
    with pytest.raises(impl.PipelineLayoutError, match="3 hash-routed layers must all sit on stage 0"):
        impl.generate_pipeline_layout(4, 3, num_hash_layers=3)


@pytest.mark.parametrize("saved", [None, [], {"_target_": "PipelineLayout"}, "<object stub>"], ids=repr)
def test_lost_layout_is_regenerated_identically(impl, saved):
    """Regression (#4306): run_config.yaml serialized the layout as an object stub; export must regenerate it."""
    expected = impl.generate_pipeline_layout(43, 4, num_hash_layers=3, mtp_layers=1)
    got = impl.resolve_pipeline_layout(saved, num_layers=43, stages=4, num_hash_layers=3, mtp_layers=1)
    assert got == expected


def test_saved_concrete_layout_is_kept(impl):
    saved = [["embedding", "decoder", "decoder", "decoder"], ["decoder", "mtp", "loss"]]
    got = impl.resolve_pipeline_layout(saved, num_layers=4, stages=2, num_hash_layers=1, mtp_layers=1)
    assert got == tuple(tuple(s) for s in saved)
    assert impl.generate_pipeline_layout(4, 2, num_hash_layers=1, mtp_layers=1) != got  # not a regenerated one


def test_saved_layout_with_hash_layer_off_stage_zero_is_rejected(impl):
    saved = [["embedding", "decoder"], ["decoder", "decoder", "decoder", "mtp", "loss"]]
    with pytest.raises(impl.PipelineLayoutError, match="hash layers"):
        impl.resolve_pipeline_layout(saved, num_layers=4, stages=2, num_hash_layers=2, mtp_layers=1)


def test_stage_layer_numbers_partition_the_model(impl):
    layout = impl.generate_pipeline_layout(43, 8, num_hash_layers=3, mtp_layers=1)
    owned = [n for s in range(8) for n in impl.stage_layer_numbers(layout, s)]
    assert owned == list(range(43))
