"""A third-party adapter, judged by ``verify_adapter`` by what each module it wraps is, in any naming: main attention,
MTP, an off-target kind, or nothing of a V4 base; its names, halves, shapes, dtypes and selection each named when
wrong. The certification of an exported adapter: ``test_verify_adapter.py``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.data.verify_cases import (
    ALPHA,
    PRESET,
    UNCHECKED,
    R,
    base_shape,
    edited_copies,
    exported_pair,
    peft_adapter,
)
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def exported(impl, tmp_path_factory):
    """A tiny base and an adapter exported against it (fixtures/data/verify_cases.py)."""
    return exported_pair(impl, tmp_path_factory.mktemp("verify"))


def test_a_lora_on_the_mtp_layers_attention_projection_is_a_main_attention_lora(impl, exported, tmp_path):
    """MTP's wq_a is one of the five main projections (vLLM reads it under the official name): an official-naming
    adapter on it and on layer 0's passes, with no line calling it an off-target module."""
    base = exported[0]
    shape = base_shape(base, "mtp.0.attn.wq_a.weight")
    adapter = peft_adapter(tmp_path / "a", {"layers.0.attn.wq_a": shape, "mtp.0.attn.wq_a": shape}, ["wq_a"])
    result = impl.verify_adapter(base, adapter)
    assert result.ok and not result.problems, f"an MTP main-attention LoRA judged off-target: {result.problems}"


#: a module of the MTP layer that is none of its main projections -> its leaf (what the kind line lists)
MTP_OFF_TARGET = {
    "mtp.0.attn.indexer.wq_b": "indexer.wq_b",
    "mtp.0.e_proj": "e_proj",
    "mtp.0.ffn.shared_experts.w1": "shared_experts.w1",
}


@pytest.mark.parametrize("module", sorted(MTP_OFF_TARGET))
def test_a_lora_on_the_mtp_layer_outside_its_main_attention_is_named_an_mtp_module(impl, exported, tmp_path, module):
    """Engines treat the MTP layer as one thing (vLLM applies no LoRA there, SGLang serves it as a draft model): any
    module of it but the main projections, its indexer included, is reported as an MTP module, never unknown."""
    base, leaf = exported[0], MTP_OFF_TARGET[module]
    shape = (64, 48) if "indexer" in module else base_shape(base, module + ".weight")  # the tiny MTP has no indexer
    modules = {"layers.0.attn.wq_a": base_shape(base, "layers.0.attn.wq_a.weight"), module: shape}
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["wq_a", leaf]))
    said = [p for p in result.problems if p.startswith("1 modules are MTP modules")]
    assert said and f"({leaf})" in said[0] and module in said[0], f"{module}: not an MTP module: {result.problems}"


def test_names_in_megatrons_native_layout_are_named_as_no_v4_module_mtp_included(impl, exported, tmp_path):
    """A PEFT file holding Megatron's own module names (decoder.layers.N..., mtp.layers.0...) is in no dialect any
    consumer loads: each of its modules, the MTP one too, is one a V4 base does not have."""
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {
        "decoder.layers.0.self_attention.wq_a": shape,
        "mtp.layers.0.mtp_model_layer.self_attention.wq_a": shape,
    }
    result = impl.verify_adapter(exported[0], peft_adapter(tmp_path / "a", modules, ["wq_a"]))
    assert any(p.startswith("2 modules name nothing of a V4 base") for p in result.problems), result.problems


def test_an_official_regex_target_modules_is_matched_against_every_official_module_of_the_base(
    impl, exported, tmp_path
):
    """PEFT fullmatches a str target_modules against every module path of the model: for an official-naming adapter
    that is the official paths, off-target modules included, so a module it would wrap without tensors is named."""
    base = exported[0]
    modules = {
        "layers.0.attn.wq_a": base_shape(base, "layers.0.attn.wq_a.weight"),
        "layers.0.ffn.shared_experts.w1": base_shape(base, "layers.0.ffn.shared_experts.w1.weight"),
    }
    regex = r"layers\.0\.attn\.wq_a|layers\.[01]\.ffn\.shared_experts\.w1"
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, regex))
    selection = [p for p in result.problems if "target_modules" in p]
    want = "1 modules target_modules also selects have no tensors in the adapter, e.g. layers.1.ffn.shared_experts.w1"
    assert selection == [want], f"the selection over the official module paths: {selection}"


def test_a_lora_on_an_off_target_module_is_held_to_its_base_weights_shape(impl, exported, tmp_path):
    """A transformers-named shared-expert LoRA whose lora_A does not fit the base's shared_experts.w1 is named, with
    that base weight and its shape, besides being reported as off-target."""
    base = exported[0]
    out_f, in_f = base_shape(base, "layers.0.ffn.shared_experts.w1.weight")
    modules = {
        "model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight"),
        "model.layers.0.mlp.shared_experts.gate_proj": (out_f, in_f - 1),
    }
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["q_a_proj", "gate_proj"]))
    want = f"expected [r={R}, in={in_f}] for layers.0.ffn.shared_experts.w1.weight [{out_f}, {in_f}]"
    assert any("shared_experts.gate_proj.lora_A" in p and want in p for p in result.problems), result.problems


def test_a_full_weight_saved_beside_the_lora_is_named_by_its_kind(impl, exported, tmp_path):
    """A full weight PEFT saved (modules_to_save) under its parameter name is read back to its module: the line
    says it is the embedding, not that the tensor has no PEFT name."""
    base = exported[0]
    embed = torch.zeros(base_shape(base, "embed.weight"))
    modules = {"model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight")}
    extra = {"base_model.model.model.embed_tokens.weight": embed}
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["q_a_proj"], extra))
    saved = [p for p in result.problems if p.startswith("1 full weights")]
    assert saved and "embedding" in saved[0], f"the saved embedding is not named as one: {result.problems}"
    assert not any("not PEFT LoRA tensor names" in p for p in result.problems), result.problems


def test_an_rslora_adapter_reports_peft_s_scale_alpha_over_the_root_of_r(impl, exported, tmp_path):
    """With use_rslora PEFT scales B@A by lora_alpha / sqrt(r), not lora_alpha / r: the config row says which (at a
    rank whose root is neither r / 2 nor 2, so no other formula lands on the same scale)."""
    base, r = exported[0], 16
    modules = {"model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight")}
    adapter = peft_adapter(tmp_path / "a", modules, ["q_a_proj"], r=r, use_rslora=True)
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    scale = ALPHA / math.sqrt(r)
    assert rows.get("config") == f"LoRA r={r} alpha={ALPHA}, rsLoRA: scale alpha/sqrt(r) = {scale:g}", rows


def test_an_adapter_mixing_naming_dialects_is_refused_naming_both(impl, exported, tmp_path):
    """One file with official and transformers names is loaded whole by no consumer: each reads one naming. That is
    its one problem: its selection is not judged in either naming, which would leave the other's module out."""
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {"layers.0.attn.wq_a": shape, "model.layers.1.self_attn.q_a_proj": shape}
    selects_both = r"layers\.0\.attn\.wq_a|model\.layers\.1\.self_attn\.q_a_proj"
    adapter = peft_adapter(tmp_path / "a", modules, selects_both)
    problems = impl.verify_adapter(exported[0], adapter).problems
    want = f"{adapter / 'adapter_model.safetensors'}: module names mix the dialects ['official', 'transformers']"
    assert problems == [want], f"the mix of dialects is not named as the one problem: {problems}"


def test_an_adapter_on_shared_experts_alone_is_read_in_its_naming(impl, exported, tmp_path):
    """A shared expert has a module in each naming, so its name says the dialect: its kind is the one problem."""
    base = exported[0]
    modules = {"layers.0.ffn.shared_experts.w1": base_shape(base, "layers.0.ffn.shared_experts.w1.weight")}
    problems = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["w1"])).problems
    assert len(problems) == 1 and problems[0].startswith("1 modules are shared expert modules"), problems


def test_a_module_on_a_layer_the_base_lacks_is_named_with_the_weight_it_would_adapt(impl, exported, tmp_path):
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    result = impl.verify_adapter(exported[0], peft_adapter(tmp_path / "a", {"layers.99.attn.wq_a": shape}, ["wq_a"]))
    want = "layers.99.attn.wq_a: resolves to no base tensor (layers.99.attn.wq_a.weight)"
    assert want in result.problems, f"the module beyond the base's layers is not named: {result.problems}"


def test_modules_resolving_to_one_absent_weight_are_one_line_counting_the_others(impl, exported, tmp_path):
    """Two namings of the same absent weight are one cause: one line, the first module and how many more."""
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {"layers.99.attn.wq_a": shape, "model.layers.99.self_attn.q_a_proj": shape}
    result = impl.verify_adapter(exported[0], peft_adapter(tmp_path / "a", modules, ["wq_a", "q_a_proj"]))
    absent = [p for p in result.problems if "resolves to no base tensor (layers.99.attn.wq_a.weight)" in p]
    assert len(absent) == 1 and absent[0].endswith(" (and 1 more)"), f"the absent weight's lines: {result.problems}"


def test_a_config_that_is_not_a_json_object_is_one_problem(impl, exported, tmp_path):
    base, adapter = edited_copies(exported, tmp_path, lambda a, b: (a / "adapter_config.json").write_text("[]"))
    result = impl.verify_adapter(base, adapter)
    said = [p for p in result.problems if "a JSON list, expected an object" in p]
    assert len(said) == 1, f"a config that is a JSON list, said {len(said)} times: {result.problems}"


#: the module whose halves the tests of a half's own shape and dtype give verify_adapter, and each half's key
Q_A = "model.layers.0.self_attn.q_a_proj"
Q_A_HALVES = {half: f"base_model.model.{Q_A}.{half}.weight" for half in ("lora_A", "lora_B")}


def _problems_of_halves(impl, exported, tmp_path, lora_a: torch.Tensor, lora_b: torch.Tensor) -> list[str]:
    """What verify_adapter says of an adapter holding ``lora_a`` and ``lora_b`` as ``Q_A``'s halves, and no more."""
    halves = {Q_A_HALVES["lora_A"]: lora_a, Q_A_HALVES["lora_B"]: lora_b}
    return impl.verify_adapter(exported[0], peft_adapter(tmp_path / "a", {}, ["q_a_proj"], halves)).problems


@pytest.mark.parametrize("dims", [1, 3])
def test_a_lora_half_that_is_not_two_dimensional_is_named_with_its_shape(impl, exported, tmp_path, dims):
    """Even one whose leading dimensions agree with [r, in]: a 1-D lora_A of length r, a 3-D one [r, in, 1]."""
    out_f, in_f = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    shape = [R, in_f, 1][:dims]
    problems = _problems_of_halves(impl, exported, tmp_path, torch.zeros(shape), torch.zeros(out_f, R))
    want = f"{Q_A}.lora_A: shape {shape}, expected [r={R}, in={in_f}]"
    assert any(p.startswith(want) for p in problems), f"the {dims}-D lora_A is not named: {problems}"


def test_a_third_party_adapter_is_validated_without_a_base_by_what_target_modules_selects(impl, exported, tmp_path):
    """Without a base, a third-party adapter's target_modules can only be held to covering its own modules: one
    that selects them all passes, one that leaves a module out is refused naming it."""
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    q_a = "model.layers.0.self_attn.q_a_proj"
    covered = peft_adapter(tmp_path / "covered", {q_a: shape}, ["q_a_proj"])
    assert impl.validate_adapter_dir(covered, require_complete=False)["modules"] == [q_a]
    kv = "model.layers.0.self_attn.kv_proj"
    uncovered = peft_adapter(tmp_path / "uncovered", {q_a: shape, kv: shape}, ["q_a_proj"])
    with pytest.raises(impl.AdapterValidationError, match=f"not selected by target_modules, e.g. {re.escape(kv)}"):
        impl.validate_adapter_dir(uncovered, require_complete=False)


#: a module of layer 0 that is no main-attention projection -> (its kind, the leaf the kind line lists)
OFF_TARGET = {
    "layers.0.ffn.shared_experts.w1": ("shared expert", "shared_experts.w1"),
    "layers.0.ffn.experts.0.w1": ("routed expert", "experts.0.w1"),
    "layers.0.ffn.gate": ("router", "gate"),
    "layers.0.attn_norm": ("norm", "attn_norm"),
    "head": ("head", "head"),  # a module path without a dot: its leaf is the whole path
    "model.layers.0.mlp.shared_experts.gate_proj": (
        "shared expert",
        "shared_experts.w1",
    ),  # listed by its official leaf
}


@pytest.mark.parametrize("module", sorted(OFF_TARGET))
def test_a_lora_on_a_module_that_is_no_main_attention_projection_is_named_by_its_kind(impl, exported, tmp_path, module):
    base, (kind, leaf) = exported[0], OFF_TARGET[module]
    shape = base_shape(base, "layers.0.attn.wq_a.weight")  # the kind is judged by the name, whatever the shape
    modules = {"layers.0.attn.wq_a": shape, module: shape}
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["wq_a", module.rsplit(".", 1)[-1]]))
    said = [p for p in result.problems if p.startswith(f"1 modules are {kind} modules ({leaf})")]
    assert said and module in said[0], f"{module}: not named a {kind} module: {result.problems}"
    assert not any(UNCHECKED in p for p in result.problems), f"{module}: a check stumbled: {result.problems}"


def _stacked(official: str):
    """An edit of the base storing its weight ``official`` with a third dimension (of 1)."""

    def stack(adapter, base):
        (shard,) = base.glob("*.safetensors")
        tensors = load_file(shard)
        tensors[official] = tensors[official].unsqueeze(-1)
        save_file(tensors, shard)

    return stack


@pytest.mark.parametrize(
    "module,stacked",
    [
        pytest.param("layers.0.attn_norm", False, id="one-dimensional-norm-weight"),
        pytest.param("layers.0.attn.wq_a", True, id="three-dimensional-projection-weight"),
    ],
)
def test_a_lora_on_a_one_or_three_dimensional_base_weight_is_named_as_no_weight_lora_adapts(
    impl, exported, tmp_path, module, stacked
):
    """A norm's 1-D weight, and a base weight stored with a third dimension, are no [out, in] matrix, even when the
    halves fit the latter's first two."""
    official = f"{module}.weight"
    shape = base_shape(exported[0], official)
    base, stored, halves = exported[0], shape, (shape[0], shape[0])  # a 1-D weight: square halves of its length
    if stacked:
        base, stored, halves = edited_copies(exported, tmp_path, _stacked(official))[0], [*shape, 1], tuple(shape)
    adapter = peft_adapter(tmp_path / "a", {module: halves}, [module.rsplit(".", 1)[-1]])
    want = f"{module}: the base weight {official} has shape {stored}, not a 2-D weight"
    problems = impl.verify_adapter(base, adapter).problems
    assert any(p.startswith(want) for p in problems), (
        f"the {len(stored)}-D base weight {official} is not named: {problems}"
    )


def test_a_dora_adapter_is_one_line_counting_its_magnitude_vectors(impl, exported, tmp_path):
    """DoRA's delta is no s*B@A: the config line says so once, with how many magnitude vectors it carries."""
    base = exported[0]
    out_f, in_f = base_shape(base, "layers.0.attn.wq_a.weight")
    modules = {f"model.layers.{i}.self_attn.q_a_proj": (out_f, in_f) for i in range(2)}
    magnitudes = {f"base_model.model.{m}.lora_magnitude_vector": torch.ones(out_f) for m in modules}
    adapter = peft_adapter(tmp_path / "a", modules, list(modules), magnitudes, use_dora=True)
    said = [p for p in impl.verify_adapter(base, adapter).problems if "use_dora=True" in p]
    assert len(said) == 1 and "(2 lora_magnitude_vector tensors)" in said[0], f"the DoRA lines: {said}"


def test_a_list_target_modules_selects_its_leaves_on_every_layer_as_peft_does(impl, exported, tmp_path):
    """PEFT matches a transformers adapter's list of names as suffixes of every module path: ``["q_a_proj"]`` wraps
    that projection on every layer, so an adapter with tensors for layer 0 only leaves the others wrapped empty."""
    base = exported[0]
    modules = {"model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight")}
    result = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["q_a_proj"]))
    others = get_preset(PRESET).num_hidden_layers - 1
    want = f"{others} modules target_modules also selects have no tensors in the adapter, e.g. model.layers.1."
    assert any(p.startswith(want) for p in result.problems), f"the layers the list also selects: {result.problems}"


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_lora_a_narrower_or_wider_than_the_base_weights_input_is_named(impl, exported, tmp_path, extra):
    base = exported[0]
    out_f, in_f = base_shape(base, "layers.0.attn.wq_a.weight")
    module = "model.layers.0.self_attn.q_a_proj"
    adapter = peft_adapter(tmp_path / "a", {module: (out_f, in_f + extra)}, ["q_a_proj"])
    want = f"{module}.lora_A: shape [{R}, {in_f + extra}], expected [r={R}, in={in_f}]"
    problems = impl.verify_adapter(base, adapter).problems
    assert any(p.startswith(want) for p in problems), f"lora_A {in_f + extra} wide is not named: {problems}"


@pytest.mark.parametrize("r", [1, 512], ids=["rank-1", "rank-512"])
def test_an_adapter_of_any_rank_peft_builds_is_sound(impl, exported, tmp_path, r):
    """r = 1 is the smallest rank PEFT builds; ranks in the hundreds are common (512: past the small integers CPython
    keeps once, so the halves are held to r by value, not by identity)."""
    module = "model.layers.0.self_attn.q_a_proj"
    modules = {module: base_shape(exported[0], "layers.0.attn.wq_a.weight")}
    adapter = peft_adapter(tmp_path / "a", modules, re.escape(module), r=r)
    result = impl.verify_adapter(exported[0], adapter)
    assert result.ok, f"a rank-{r} adapter is refused: {result.problems}"


def test_unreadable_config_and_tensor_files_are_each_named(impl, exported, tmp_path):
    """Both files damaged: each is named, not only the first one read."""

    def spoil(adapter, base):
        (adapter / "adapter_config.json").write_text("{")
        (adapter / "adapter_model.safetensors").write_bytes(b"no safetensors file")

    base, adapter = edited_copies(exported, tmp_path, spoil)
    problems = impl.verify_adapter(base, adapter).problems
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert any(str(adapter / name) in p and "unreadable" in p for p in problems), f"{name}: {problems}"


def test_module_names_in_no_v4_naming_are_said_to_be_in_none(impl, exported, tmp_path):
    """Megatron's own module names are in no dialect at all, which is not a mix of dialects."""
    shape = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    adapter = peft_adapter(tmp_path / "a", {"decoder.layers.0.self_attn.wq_a": shape}, ["wq_a"])
    with pytest.raises(impl.AdapterValidationError, match="in no V4 naming dialect"):
        impl.validate_adapter_dir(adapter, require_complete=False)


def test_a_prefixed_tensor_of_no_module_is_named_as_no_lora_tensor(impl, exported, tmp_path):
    """A tensor under PEFT's prefix that is neither a LoRA half nor a weight of the base is named, by its key."""
    base = exported[0]
    modules = {"model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight")}
    stray = "base_model.model.vision_tower.proj.weight"
    adapter = peft_adapter(tmp_path / "a", modules, ["q_a_proj"], {stray: torch.zeros(2, 2)})
    problems = impl.verify_adapter(base, adapter).problems
    said = [p for p in problems if stray in p]
    assert said and "not PEFT LoRA tensor names" in said[0], f"the stray tensor is not named: {problems}"


def test_an_indexer_lora_is_told_the_indexer_hazard_and_a_shared_expert_lora_no_hazard(impl, exported, tmp_path):
    """The indexer's line says what wrapping it does (the wq_b hazard, the judge's table); a kind with no such
    hazard gets no hazard clause."""
    from dsv4_conformance.judge.consumers import OFF_TARGET_HAZARD

    base = exported[0]
    modules = {
        "layers.3.attn.indexer.wq_b": base_shape(base, "layers.3.attn.indexer.wq_b.weight"),
        "layers.0.ffn.shared_experts.w1": base_shape(base, "layers.0.ffn.shared_experts.w1.weight"),
    }
    problems = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["wq_b", "w1"])).problems
    indexer = [p for p in problems if p.startswith("1 modules are indexer modules")]
    shared = [p for p in problems if p.startswith("1 modules are shared expert modules")]
    assert indexer and OFF_TARGET_HAZARD["indexer"] in indexer[0], f"the indexer's hazard is not said: {problems}"
    assert shared and "None" not in shared[0], f"the shared expert's line: {shared}"


def test_each_modules_shape_is_checked_after_a_module_on_a_weight_lora_cannot_adapt(impl, exported, tmp_path):
    base = exported[0]
    (hidden,) = base_shape(base, "layers.0.attn_norm.weight")
    out_f, in_f = base_shape(base, "layers.1.attn.wq_a.weight")
    modules = {"layers.0.attn_norm": (hidden, hidden), "layers.1.attn.wq_a": (out_f, in_f + 1)}
    problems = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, ["attn_norm", "wq_a"])).problems
    assert any(p.startswith("layers.0.attn_norm: the base weight") for p in problems), problems
    want = f"layers.1.attn.wq_a.lora_A: shape [{R}, {in_f + 1}], expected [r={R}, in={in_f}]"
    assert any(p.startswith(want) for p in problems), f"the module after the norm is not checked: {problems}"


def test_a_lora_b_of_the_wrong_height_is_named_with_the_out_and_r_it_needs(impl, exported, tmp_path):
    out_f, in_f = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    problems = _problems_of_halves(impl, exported, tmp_path, torch.zeros(R, in_f), torch.zeros(out_f - 1, R))
    want = f"{Q_A}.lora_B: shape [{out_f - 1}, {R}], expected [out={out_f}, r={R}]"
    assert any(p.startswith(want) for p in problems), f"the short lora_B is not named: {problems}"


def test_every_tensor_of_a_dtype_no_lora_weight_has_is_named(impl, exported, tmp_path):
    """An integer adapter (a quantized export, say): each of its tensors is named, not only the first."""
    out_f, in_f = base_shape(exported[0], "layers.0.attn.wq_a.weight")
    lora_a, lora_b = torch.zeros(R, in_f, dtype=torch.int8), torch.zeros(out_f, R, dtype=torch.int8)
    problems = _problems_of_halves(impl, exported, tmp_path, lora_a, lora_b)
    for key in Q_A_HALVES.values():
        assert any(p.startswith(f"{key}: dtype int8") for p in problems), f"{key} is not named: {problems}"


def test_a_target_modules_that_is_no_regular_expression_is_one_problem(impl, exported, tmp_path):
    """It is the config's problem; the selection, which it cannot make, is not judged as well."""
    module = "model.layers.0.self_attn.q_a_proj"
    modules = {module: base_shape(exported[0], "layers.0.attn.wq_a.weight")}
    problems = impl.verify_adapter(exported[0], peft_adapter(tmp_path / "a", modules, "(unclosed")).problems
    assert len(problems) == 1 and "target_modules" in problems[0], f"the unparsable target_modules: {problems}"


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_pattern_key_that_is_no_regular_expression_gets_a_verdict_naming_the_adapter(impl, exported, tmp_path, field):
    """PEFT matches each pattern key as a regular expression, so a key that is none breaks its load: verify-adapter
    names the key as its own problem (every other check still runs), and the library refuses it naming the key."""
    module = "model.layers.0.self_attn.q_a_proj"
    modules = {module: base_shape(exported[0], "layers.0.attn.wq_a.weight")}
    adapter = peft_adapter(tmp_path / "a", modules, re.escape(module), **{field: {"(unclosed": 2 * R}})
    result = impl.verify_adapter(exported[0], adapter)
    named = [p for p in result.problems if str(adapter) in p and "'(unclosed'" in p and field in p]
    assert not result.ok and named, f"no problem names the {field} key '(unclosed': {result.problems}"
    assert not any("could not be checked" in p for p in result.problems), result.problems
    with pytest.raises(impl.AdapterValidationError, match=re.escape(f"{field} key '(unclosed'")):
        impl.validate_adapter_dir(adapter, require_complete=False)


#: transformers' leaf of each shared-expert projection -> the official weight it adapts
SHARED_EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def test_a_transformers_lora_on_a_shared_experts_three_projections_is_judged_by_its_kind_alone(
    impl, exported, tmp_path
):
    """transformers names w1, w3 and w2 gate_proj, up_proj and down_proj: a regex selecting exactly the three, with
    tensors for each, selects what the adapter holds; the kind is the one problem, listing all three."""
    base = exported[0]
    modules = {
        f"model.layers.0.mlp.shared_experts.{leaf}": base_shape(base, f"layers.0.ffn.shared_experts.{w}.weight")
        for leaf, w in SHARED_EXPERT_PROJECTIONS.items()
    }
    selects = r"model\.layers\.0\.mlp\.shared_experts\.(gate|up|down)_proj"
    problems = impl.verify_adapter(base, peft_adapter(tmp_path / "a", modules, selects)).problems
    kind = "3 modules are shared expert modules (shared_experts.w1, shared_experts.w2, shared_experts.w3)"
    assert len(problems) == 1 and problems[0].startswith(kind), f"the shared experts' problems: {problems}"


def test_an_official_naming_adapter_is_judged_by_the_file_checks_alone(impl, exported, tmp_path):
    """The conformance judge and the forward check read transformers' naming (what PEFT loads): for a sound adapter
    in the official naming (vLLM's) their rows say n/a, and the adapter passes."""
    base = exported[0]
    modules = {"layers.0.attn.wq_a": base_shape(base, "layers.0.attn.wq_a.weight")}
    adapter = peft_adapter(tmp_path / "a", modules, r"layers\.0\.attn\.wq_a")
    result = impl.verify_adapter(base, adapter, judge=True, forward=True)
    rows = {c.name: c for c in result.checks}
    assert result.ok and not result.problems, f"a sound official-naming adapter: {result.problems}"
    for name in ("conformance", "forward"):
        assert rows[name].passed is None and rows[name].figure.startswith("only for"), f"{name}: {rows[name]}"


def test_the_judge_refuses_a_target_modules_that_reaches_a_norm_which_peft_will_not_load(exported, tmp_path):
    """PEFT's LoRA wraps linear layers only: a ``target_modules`` that also selects ``kv_norm`` makes PEFT refuse the
    whole adapter (``Target module ... is not supported``), so the conformance judge names the norm; the same
    adapter selecting its projection alone passes."""
    from peft import PeftModel

    from dsv4_conformance.judge.artifacts import judge_adapter_dir
    from tiny_models.oracle import load_oracle

    base = exported[0]
    modules = {"model.layers.0.self_attn.q_a_proj": base_shape(base, "layers.0.attn.wq_a.weight")}
    layer = r"model\.layers\.0\.self_attn\."
    fits = peft_adapter(tmp_path / "fits", modules, layer + "q_a_proj")
    assert judge_adapter_dir(fits, base) == [], "the control: the projection alone is a valid adapter"
    norm = peft_adapter(tmp_path / "norm", modules, layer + "(q_a_proj|kv_norm)")
    problems = [str(p) for p in judge_adapter_dir(norm, base)]
    assert any("model.layers.0.self_attn.kv_norm (DeepseekV4RMSNorm)" in p for p in problems), problems
    with pytest.raises(ValueError, match="is not supported"):
        PeftModel.from_pretrained(load_oracle(base), str(norm))
