"""Rules of the native graph's configuration, as their docstrings state them: a TP size that divides the heads but
not the output groups is rejected before anything is built; the shortest test sequence is at least twice the
sliding window (so the window slides); and block recompute checkpoints exactly the first ``num_layers`` layers."""

from __future__ import annotations

import dataclasses

import pytest

from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET = "tiny-mixed"


@pytest.fixture(scope="module")
def config(impl):
    return impl.V4Config.from_hf(get_preset(PRESET))


def test_a_tp_size_dividing_the_heads_but_not_the_output_groups_is_rejected(impl, config):
    """wo_a is split over TP by whole output groups, so TP must divide o_groups as well as num_heads."""
    cfg = dataclasses.replace(config, num_heads=4, o_groups=2, vocab_size=4 * config.vocab_size)
    impl.validate_parallel_layout(cfg, tp_size=2, ep_size=1)  # the control: 2 divides both
    with pytest.raises(impl.UnsupportedConfigError, match="o_groups"):
        impl.validate_parallel_layout(cfg, tp_size=4, ep_size=1)


@pytest.mark.parametrize("window", [4, 16, 64])
def test_the_shortest_sequence_of_a_sliding_only_model_is_twice_its_window(config, window):
    """With no compressed layer the window is the only constraint: twice its width, so it slides once fully."""
    cfg = dataclasses.replace(config, window_size=window, compress_ratios=(0,) * len(config.compress_ratios))
    assert cfg.min_seq_len == 2 * window, f"window {window}: min_seq_len {cfg.min_seq_len}"


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_block_recompute_checkpoints_exactly_the_first_num_layers_layers(impl, num_layers):
    plan = impl.ActivationPlan(recompute_granularity="full", recompute_method="block", recompute_num_layers=num_layers)
    stage = 5
    recomputed = [p for p in range(stage) if plan.layer_is_recomputed(p)]
    assert recomputed == list(range(num_layers)), f"num_layers={num_layers}: recomputes positions {recomputed}"
