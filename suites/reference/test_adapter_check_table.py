"""Rows of the adapter check table that a hand-edited adapter trips: pickle weights of either common suffix beside
the safetensors file, and a per-module ``rank_pattern`` / ``alpha_pattern`` that changes a module's scale, are each
refused naming the file; a pattern that restates ``r`` and ``lora_alpha`` (as Megatron-Bridge writes one) is not."""

from __future__ import annotations

import json

import pytest

from fixtures.data.adapter_states import attention_shapes, make_native_adapter

pytestmark = pytest.mark.cpu

R = 4
SHAPES = attention_shapes(hidden=64, q_lora=48, heads=4, head_dim=32, o_groups=2, o_lora=16)


@pytest.fixture
def adapter(impl, tmp_path):
    out = tmp_path / "adapter"
    impl.export_adapter(impl.AdapterState(make_native_adapter(SHAPES, 2, R), r=R, alpha=8.0), out)
    impl.validate_adapter_dir(out)  # the export itself passes: what follows is the edit's doing
    return out


@pytest.mark.parametrize("pickle_name", ["adapter_model.bin", "adapter_model.pt"])
def test_pickle_weights_beside_an_adapter_are_refused(impl, adapter, pickle_name):
    (adapter / pickle_name).write_bytes(b"\x80\x04N.")  # a pickle of None: loading it would run the unpickler
    with pytest.raises(impl.AdapterValidationError, match=pickle_name.replace(".", r"\.")):
        impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_per_module_rank_or_alpha_pattern_that_changes_its_scale_is_refused(impl, adapter, field):
    """PEFT applies a pattern's value instead of ``r`` / ``lora_alpha`` to the modules it names, so the scale a
    serving engine uses (one ``lora_alpha / r``) would no longer be the one PEFT applies."""
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    module = "model.layers.0.self_attn.q_a_proj"
    config[field] = {module: 2 * (R if field == "rank_pattern" else config["lora_alpha"])}
    config_file.write_text(json.dumps(config))
    (adapter / impl.COMPLETE_MARKER).unlink()  # the edit makes the marker stale; the field is what is judged
    with pytest.raises(impl.AdapterValidationError, match=field):
        impl.validate_adapter_dir(adapter, require_complete=False)


def test_patterns_that_restate_r_and_alpha_for_every_module_are_accepted(impl, adapter):
    """Megatron-Bridge's save_hf_adapter writes a rank_pattern entry per module, each equal to the LoRA's rank."""
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["rank_pattern"] = {f"model.layers.{i}.self_attn.q_a_proj": config["r"] for i in range(2)}
    config["alpha_pattern"] = {r"q_a_proj": config["lora_alpha"]}
    config_file.write_text(json.dumps(config))
    (adapter / impl.COMPLETE_MARKER).unlink()
    impl.validate_adapter_dir(adapter, require_complete=False)
