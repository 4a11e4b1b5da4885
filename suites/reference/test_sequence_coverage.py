"""The shortest sequence on which every layer kind does its real work, as the implementation computes it (qualify's
and ``verify-adapter --forward``'s default length), equals the oracle's independently written rule for every tiny
preset and for the published Flash and Pro configurations."""

from __future__ import annotations

import pytest

from tiny_models.presets import PRESETS, flash_config, min_seq_len, pro_config

pytestmark = pytest.mark.cpu

CONFIGS = {**PRESETS, "flash": flash_config, "pro": pro_config}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_min_seq_len_covers_every_layer_kind_as_the_oracle_rule_says(impl, name):
    cfg = CONFIGS[name]()
    got = impl.V4Config.from_hf(cfg).min_seq_len
    assert got == min_seq_len(cfg), f"{name}: implementation {got}, oracle {min_seq_len(cfg)}"
