"""A deliberately layer-restricted adapter (LoRA on one layer's projection only) gathers and exports: the gather
claims full layer coverage only when every target is present in every layer, so the exporter's coverage check
does not reject an adapter that was meant to cover fewer layers."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from fixtures.data.native_weights import ensure_single_rank_megatron
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET = "tiny-mixed"


def test_an_adapter_on_one_layer_only_gathers_and_exports(impl, tmp_path):
    ensure_single_rank_megatron(impl)
    config = impl.V4Config.from_hf(get_preset(PRESET))
    assert config.num_layers > 1, "a one-layer model cannot show a layer-restricted adapter"
    model = impl.DeepseekV4NativeModel(config, include_mtp=False)
    handle = impl.apply_lora([model], targets=["*.layers.0.self_attention.wq_a"], rank=4, alpha=8.0)
    state = impl.gather_adapter_state([model], handle)
    out = tmp_path / "adapter"
    impl.export_adapter(state, out)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        modules = {name.rsplit(".", 2)[0] for name in f.keys()}
    assert modules == {"base_model.model.model.layers.0.self_attn.q_a_proj"}, sorted(modules)
