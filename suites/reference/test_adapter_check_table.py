"""Rows of the adapter check table that a hand-edited adapter trips: pickle weights of either common suffix beside
the safetensors file, and a per-module ``rank_pattern`` / ``alpha_pattern`` that changes a module's scale, are each
refused naming the file; a pattern that restates ``r`` and ``lora_alpha`` (as Megatron-Bridge writes one) is not.
So are a config that is not a causal-LM LoRA without biases, a rank that is not a positive integer, and a
``target_modules`` that no longer selects exactly the exported modules."""

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


def _edit_config(adapter, **fields):
    """Set ``fields`` in the adapter's config; the marker goes (it would be stale), the fields are what is judged."""
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **fields}))
    (adapter / ".complete").unlink()


@pytest.mark.parametrize(
    ("field", "value"),
    [("peft_type", "LOHA"), ("peft_type", None), ("bias", "all"), ("bias", None), ("task_type", "SEQ_CLS")],
)
def test_a_config_that_is_not_a_plain_causal_lm_lora_is_refused_naming_the_field(impl, adapter, field, value):
    _edit_config(adapter, **{field: value})
    with pytest.raises(impl.AdapterValidationError, match=f"{field}={value!r}"):
        impl.validate_adapter_dir(adapter, require_complete=False)


def test_a_config_without_a_task_type_is_accepted_as_peft_accepts_it(impl, adapter):
    _edit_config(adapter, task_type=None)
    impl.validate_adapter_dir(adapter, require_complete=False)


def test_an_export_without_its_marker_is_refused_unless_completeness_is_waived(impl, adapter):
    (adapter / impl.COMPLETE_MARKER).unlink()
    with pytest.raises(impl.AdapterValidationError, match="missing; the export never completed"):
        impl.validate_adapter_dir(adapter)
    impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("target_modules", [None, 7, ["q_a_proj", 7], "(unclosed"])
def test_a_target_modules_that_is_neither_a_regex_nor_a_list_of_names_is_refused(impl, adapter, target_modules):
    _edit_config(adapter, target_modules=target_modules)
    with pytest.raises(impl.AdapterValidationError, match="is neither a regular expression nor a list of names"):
        impl.validate_adapter_dir(adapter, require_complete=False)


def test_a_pattern_naming_no_module_of_the_adapter_changes_nothing(impl, adapter):
    """A pattern key applies to the modules whose path ends with it: one for a layer the adapter has no LoRA on
    scales no module."""
    _edit_config(adapter, rank_pattern={"model.layers.7.self_attn.q_a_proj": 2 * R})
    impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("alpha", [0, -8.0, "8", float("inf"), float("nan"), True])
def test_a_lora_alpha_that_is_not_a_positive_number_is_refused(impl, adapter, alpha):
    """Infinity and NaN (what ``json.dumps`` writes for such floats) scale every delta by them; JSON's ``true`` is
    no number, though Python counts it as 1."""
    _edit_config(adapter, lora_alpha=alpha)
    with pytest.raises(impl.AdapterValidationError, match=f"lora_alpha={alpha!r} must be positive and finite"):
        impl.validate_adapter_dir(adapter, require_complete=False)


def test_a_lora_alpha_below_one_is_accepted(impl, adapter):
    """alpha / r is the scale: an alpha under one (a scale under 1/r) is as valid as any positive one."""
    _edit_config(adapter, lora_alpha=0.5)
    impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("r", [float(R), True, 0, -R])
def test_a_rank_that_is_not_a_positive_integer_is_refused(impl, adapter, r):
    """A float or a bool that compares equal to a rank is still no rank PEFT builds a LoRA with."""
    _edit_config(adapter, r=r)
    with pytest.raises(impl.AdapterValidationError, match=f"r={r!r} must be a positive integer"):
        impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("target_modules", [r"model\.layers\.0\.self_attn\.q_a_proj", ["q_a_proj"]])
def test_an_exports_target_modules_must_select_exactly_its_modules(impl, adapter, target_modules):
    """An export records the target_modules that selects its modules and nothing else: an edited one is refused."""
    _edit_config(adapter, target_modules=target_modules)
    with pytest.raises(impl.AdapterValidationError, match="does not select exactly the"):
        impl.validate_adapter_dir(adapter, require_complete=False)


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_pattern_that_lowers_a_modules_rank_or_alpha_is_refused_as_well(impl, adapter, field):
    """A smaller value changes the scale as much as a larger one does."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    lower = R // 2 if field == "rank_pattern" else config["lora_alpha"] / 2
    _edit_config(adapter, **{field: {"model.layers.0.self_attn.q_a_proj": lower}})
    with pytest.raises(impl.AdapterValidationError, match=field):
        impl.validate_adapter_dir(adapter, require_complete=False)
