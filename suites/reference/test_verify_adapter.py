"""``verify-adapter``'s checks through the public ``verify_adapter``: an exported adapter against its base passes, and
each spoilt adapter or base is reported with the tensor or file that is wrong. The same cases run through the command
line after a full ``qualify`` in ``test_cli``; here a tiny base and an exported adapter suffice, so they are fast.
A third-party adapter is judged by what each module it wraps is, in any naming: main attention, MTP, an off-target
kind, or nothing of a V4 base."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fixtures.data.adapter_states import export_fingerprinted_adapter
from fixtures.data.adapter_tamper import TAMPER, UNCERTIFY
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET, R, ALPHA = "tiny-mixed", 4, 8.0
#: the last resort a problem falls to when a check stumbles (impl/adapter/validation.py): never a finding
UNCHECKED = "could not be checked"
#: docs/fingerprint.md: a tensor of more bytes than 64 pages of 4096 is compared by those pages unless hashed in full
SAMPLED_ABOVE = 64 * 4096


@pytest.fixture(scope="module")
def exported(impl, tmp_path_factory):
    """A tiny official-layout base and an adapter on the five main targets exported against it, fingerprinted."""
    root = tmp_path_factory.mktemp("verify")
    base = write_checkpoint(PRESET, root / "base", seed=2)
    return base, export_fingerprinted_adapter(impl, base, root / "adapter", get_preset(PRESET), r=R, alpha=ALPHA)


def _edited_copies(exported, tmp_path, edit):
    """Copies of the exported base and adapter under ``tmp_path``, then ``edit(adapter, base)`` applied to them."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(exported[0], base)
    shutil.copytree(exported[1], adapter)
    edit(adapter, base)
    return base, adapter


def test_an_exported_adapter_passes_against_its_base(impl, exported):
    base, adapter = exported
    result = impl.verify_adapter(base, adapter)
    assert result.ok and not result.problems, f"problems: {result.problems}"


@pytest.mark.parametrize("content", ["null", "[]", '"done"', "3"])
def test_a_marker_that_is_no_json_object_certifies_nothing(impl, exported, tmp_path, content):
    """A ``.complete`` that holds no object is present but certifies no file: the adapter beside it is refused,
    never certified (found by the property test: a re-saved adapter beside a ``null`` marker passed)."""
    base, adapter = _edited_copies(exported, tmp_path, lambda a, b: (a / ".complete").write_text(content))
    result = impl.verify_adapter(base, adapter)
    assert not result.ok, f".complete = {content}: verify_adapter certified the adapter"
    assert any(".complete" in p and "expected an object" in p for p in result.problems), result.problems


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_each_spoilt_adapter_or_base_is_reported_by_name(impl, exported, tmp_path, case):
    tamper, expected = TAMPER[case]
    base, adapter = _edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter)
    problems = "\n".join(result.problems)
    assert not result.ok, f"{case}: verify_adapter passed a spoilt adapter"
    assert expected in problems, f"{case}: the problem list does not name {expected!r}:\n{problems}"


@pytest.mark.parametrize("case", sorted(UNCERTIFY))
def test_a_sound_adapter_without_provenance_is_uncertified_not_wrong(impl, exported, tmp_path, case):
    """Without ``.complete`` an adapter cannot prove its completeness: it passes as uncertified, and fails only when
    certification is required, naming what is missing."""
    edit, expected = UNCERTIFY[case]
    base, adapter = _edited_copies(exported, tmp_path, edit)
    result = impl.verify_adapter(base, adapter)
    assert result.ok, f"{case}: an otherwise sound adapter failed: {result.problems}"
    assert result.uncertified and expected in result.uncertified, f"{case}: provenance says {result.uncertified!r}"
    strict = impl.verify_adapter(base, adapter, require_certified=True)
    assert not strict.ok and any(expected in p for p in strict.problems), strict.problems


def test_an_exported_adapter_is_certified(impl, exported):
    result = impl.verify_adapter(*exported, require_certified=True)
    assert result.ok and result.uncertified is None, (result.problems, result.checks[-1])


def test_verify_adapter_reads_without_importing_torch(impl, exported):
    """The checks read bytes, shapes and dtypes: importing torch would cost the command about a second and
    ~500 MB before it reads anything (``pytest -m bench -s suites/reference/test_bench_full_size_base.py``)."""
    from fixtures.runner.subproc import cli_imports

    base, adapter = exported
    status, torch_imported, out = cli_imports(
        impl.name, ["verify-adapter", "--base", base, "--adapter", adapter], "torch"
    )
    assert status == 0 and not torch_imported, out[-4000:]


#: the spoilt adapters the conformance judge sees from the files alone (the others are about the base or provenance)
JUDGED = ("indexer-wrapping", "wrong-shape-lora_B", "nan", "missing-half")


def test_the_conformance_judge_passes_an_exported_adapter(impl, exported):
    """``--judge`` adds the conformance suites' own verdict (``dsv4_conformance.judge``) as a row of its own."""
    result = impl.verify_adapter(*exported, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed, f"the judge's row: {row}; problems: {result.problems}"


@pytest.mark.parametrize("case", JUDGED)
def test_the_conformance_judge_fails_a_spoilt_adapter(impl, exported, tmp_path, case):
    tamper, _ = TAMPER[case]
    base, adapter = _edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed is False, f"{case}: the judge's row passed a spoilt adapter: {row}"


# --- every module an adapter wraps is judged by what it is (impl/adapter/kinds.py), through verify_adapter ---------


def _base_shape(base, official: str) -> list[int]:
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if official in f.keys():
                return f.get_slice(official).get_shape()
    raise KeyError(f"the tiny base has no {official}")


def _peft_adapter(path, modules, target_modules, extra=None, *, r=R, **config_fields):
    """A third-party PEFT adapter at ``path``: lora_A [r, in] and lora_B [out, r] for each module path -> (out, in),
    the tensors ``extra`` beside them, and an ``adapter_config.json`` with ``target_modules`` (and ``config_fields``)."""
    tensors = dict(extra or {})
    for module, (out_f, in_f) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.full((r, in_f), 0.01)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.full((out_f, r), 0.01)
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "r": r, "lora_alpha": ALPHA}
    config |= {"target_modules": target_modules, **config_fields}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_a_lora_on_the_mtp_layers_attention_projection_is_a_main_attention_lora(impl, exported, tmp_path):
    """MTP's wq_a is one of the five main projections (vLLM reads it under the official name): an official-naming
    adapter on it and on layer 0's passes, with no line calling it an off-target module."""
    base = exported[0]
    shape = _base_shape(base, "mtp.0.attn.wq_a.weight")
    adapter = _peft_adapter(tmp_path / "a", {"layers.0.attn.wq_a": shape, "mtp.0.attn.wq_a": shape}, ["wq_a"])
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
    shape = (64, 48) if "indexer" in module else _base_shape(base, module + ".weight")  # the tiny MTP has no indexer
    modules = {"layers.0.attn.wq_a": _base_shape(base, "layers.0.attn.wq_a.weight"), module: shape}
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["wq_a", leaf]))
    said = [p for p in result.problems if p.startswith("1 modules are MTP modules")]
    assert said and f"({leaf})" in said[0] and module in said[0], f"{module}: not an MTP module: {result.problems}"


def test_names_in_megatrons_native_layout_are_named_as_no_v4_module_mtp_included(impl, exported, tmp_path):
    """A PEFT file holding Megatron's own module names (decoder.layers.N..., mtp.layers.0...) is in no dialect any
    consumer loads: each of its modules, the MTP one too, is one a V4 base does not have."""
    shape = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {
        "decoder.layers.0.self_attention.wq_a": shape,
        "mtp.layers.0.mtp_model_layer.self_attention.wq_a": shape,
    }
    result = impl.verify_adapter(exported[0], _peft_adapter(tmp_path / "a", modules, ["wq_a"]))
    assert any(p.startswith("2 modules name nothing of a V4 base") for p in result.problems), result.problems


def test_an_official_regex_target_modules_is_matched_against_every_official_module_of_the_base(
    impl, exported, tmp_path
):
    """PEFT fullmatches a str target_modules against every module path of the model: for an official-naming adapter
    that is the official paths, off-target modules included, so a module it would wrap without tensors is named."""
    base = exported[0]
    modules = {
        "layers.0.attn.wq_a": _base_shape(base, "layers.0.attn.wq_a.weight"),
        "layers.0.ffn.shared_experts.w1": _base_shape(base, "layers.0.ffn.shared_experts.w1.weight"),
    }
    regex = r"layers\.0\.attn\.wq_a|layers\.[01]\.ffn\.shared_experts\.w1"
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, regex))
    selection = [p for p in result.problems if "target_modules" in p]
    want = "1 modules target_modules also selects have no tensors in the adapter, e.g. layers.1.ffn.shared_experts.w1"
    assert selection == [want], f"the selection over the official module paths: {selection}"


def test_a_lora_on_an_off_target_module_is_held_to_its_base_weights_shape(impl, exported, tmp_path):
    """A transformers-named shared-expert LoRA whose lora_A does not fit the base's shared_experts.w1 is named, with
    that base weight and its shape, besides being reported as off-target."""
    base = exported[0]
    out_f, in_f = _base_shape(base, "layers.0.ffn.shared_experts.w1.weight")
    modules = {
        "model.layers.0.self_attn.q_a_proj": _base_shape(base, "layers.0.attn.wq_a.weight"),
        "model.layers.0.mlp.shared_experts.gate_proj": (out_f, in_f - 1),
    }
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["q_a_proj", "gate_proj"]))
    want = f"expected [r={R}, in={in_f}] for layers.0.ffn.shared_experts.w1.weight [{out_f}, {in_f}]"
    assert any("shared_experts.gate_proj.lora_A" in p and want in p for p in result.problems), result.problems


def test_a_full_weight_saved_beside_the_lora_is_named_by_its_kind(impl, exported, tmp_path):
    """A full weight PEFT saved (modules_to_save) under its parameter name is read back to its module: the line
    says it is the embedding, not that the tensor has no PEFT name."""
    base = exported[0]
    embed = torch.zeros(_base_shape(base, "embed.weight"))
    modules = {"model.layers.0.self_attn.q_a_proj": _base_shape(base, "layers.0.attn.wq_a.weight")}
    extra = {"base_model.model.model.embed_tokens.weight": embed}
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["q_a_proj"], extra))
    saved = [p for p in result.problems if p.startswith("1 full weights")]
    assert saved and "embedding" in saved[0], f"the saved embedding is not named as one: {result.problems}"
    assert not any("not PEFT LoRA tensor names" in p for p in result.problems), result.problems


# --- what each check row says, and problems the checks name (impl/adapter/validation.py) -------------------------


def test_each_check_row_says_what_it_found_on_a_sound_adapter(impl, exported):
    """The rows a user reads for a passing adapter: how many files the marker certifies, the LoRA's r and alpha, the
    modules and their dialect, and by how many tensors' every byte the base was matched."""
    base, adapter = exported
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        fingerprinted = len(json.loads(f.metadata()["dsv4_base_fingerprint"])["tensors"])
    modules = 5 * get_preset(PRESET).num_hidden_layers  # the five main targets of every layer
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    want = {
        "marker": "certifies 2 files",
        "config": f"LoRA r={R} alpha={ALPHA}",
        "names": f"{modules} modules, dialect transformers",
        "fingerprint": f"matches the base (every byte of {fingerprinted} tensors)",
        "shapes": "agree with r and the base",
        "provenance": "certified: .complete and base fingerprint recorded",
    }
    assert {name: rows.get(name) for name in want} == want, f"the check rows: {rows}"


def test_the_fingerprint_row_says_not_checked_when_the_base_cannot_be_read(impl, exported, tmp_path):
    base, adapter = _edited_copies(exported, tmp_path, lambda adapter, base: (base / "config.json").unlink())
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    assert rows.get("fingerprint") == "not checked (no base given)", f"the check rows: {rows}"


def test_an_rslora_adapter_reports_peft_s_scale_alpha_over_the_root_of_r(impl, exported, tmp_path):
    """With use_rslora PEFT scales B@A by lora_alpha / sqrt(r), not lora_alpha / r: the config row says which (at a
    rank whose root is neither r / 2 nor 2, so no other formula lands on the same scale)."""
    base, r = exported[0], 16
    modules = {"model.layers.0.self_attn.q_a_proj": _base_shape(base, "layers.0.attn.wq_a.weight")}
    adapter = _peft_adapter(tmp_path / "a", modules, ["q_a_proj"], r=r, use_rslora=True)
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    scale = ALPHA / math.sqrt(r)
    assert rows.get("config") == f"LoRA r={r} alpha={ALPHA}, rsLoRA: scale alpha/sqrt(r) = {scale:g}", rows


def test_an_adapter_mixing_naming_dialects_is_refused_naming_both(impl, exported, tmp_path):
    """One file with official and transformers names is loaded whole by no consumer: each reads one naming. That is
    its one problem: its selection is not judged in either naming, which would leave the other's module out."""
    shape = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {"layers.0.attn.wq_a": shape, "model.layers.1.self_attn.q_a_proj": shape}
    selects_both = r"layers\.0\.attn\.wq_a|model\.layers\.1\.self_attn\.q_a_proj"
    adapter = _peft_adapter(tmp_path / "a", modules, selects_both)
    problems = impl.verify_adapter(exported[0], adapter).problems
    want = f"{adapter / 'adapter_model.safetensors'}: module names mix the dialects ['official', 'transformers']"
    assert problems == [want], f"the mix of dialects is not named as the one problem: {problems}"


def test_an_adapter_on_shared_experts_alone_is_read_in_its_naming(impl, exported, tmp_path):
    """A shared expert has a module in each naming, so its name says the dialect: its kind is the one problem."""
    base = exported[0]
    modules = {"layers.0.ffn.shared_experts.w1": _base_shape(base, "layers.0.ffn.shared_experts.w1.weight")}
    problems = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["w1"])).problems
    assert len(problems) == 1 and problems[0].startswith("1 modules are shared expert modules"), problems


def test_with_a_base_validate_adapter_dir_requires_certification_unless_told_not_to(impl, exported, tmp_path):
    """The library's check against a base refuses an adapter that cannot prove it was trained on it, by default."""
    base, adapter = _edited_copies(exported, tmp_path, lambda adapter, base: (adapter / ".complete").unlink())
    with pytest.raises(impl.AdapterValidationError, match="uncertified"):
        impl.validate_adapter_dir(adapter, base=base, require_complete=False)
    impl.validate_adapter_dir(adapter, base=base, require_complete=False, require_certified=False)


def test_a_module_on_a_layer_the_base_lacks_is_named_with_the_weight_it_would_adapt(impl, exported, tmp_path):
    shape = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    result = impl.verify_adapter(exported[0], _peft_adapter(tmp_path / "a", {"layers.99.attn.wq_a": shape}, ["wq_a"]))
    want = "layers.99.attn.wq_a: resolves to no base tensor (layers.99.attn.wq_a.weight)"
    assert want in result.problems, f"the module beyond the base's layers is not named: {result.problems}"


def test_modules_resolving_to_one_absent_weight_are_one_line_counting_the_others(impl, exported, tmp_path):
    """Two namings of the same absent weight are one cause: one line, the first module and how many more."""
    shape = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    modules = {"layers.99.attn.wq_a": shape, "model.layers.99.self_attn.q_a_proj": shape}
    result = impl.verify_adapter(exported[0], _peft_adapter(tmp_path / "a", modules, ["wq_a", "q_a_proj"]))
    absent = [p for p in result.problems if "resolves to no base tensor (layers.99.attn.wq_a.weight)" in p]
    assert len(absent) == 1 and absent[0].endswith(" (and 1 more)"), f"the absent weight's lines: {result.problems}"


def test_a_config_that_is_not_a_json_object_is_one_problem(impl, exported, tmp_path):
    base, adapter = _edited_copies(exported, tmp_path, lambda a, b: (a / "adapter_config.json").write_text("[]"))
    result = impl.verify_adapter(base, adapter)
    said = [p for p in result.problems if "a JSON list, expected an object" in p]
    assert len(said) == 1, f"a config that is a JSON list, said {len(said)} times: {result.problems}"


#: what the fingerprint's metadata entry holds instead of a fingerprint -> how the problem line ends
NO_FINGERPRINT = {
    "no-json": ("{tensors", "unreadable base fingerprint metadata"),
    "no-digest": (
        json.dumps({"tensors": {"layers.0.attn.wq_a.weight": {"shape": [1]}}}),
        "the base fingerprint metadata is not a dsv4-lora fingerprint",
    ),
}


@pytest.mark.parametrize("case", sorted(NO_FINGERPRINT))
def test_a_fingerprint_entry_that_is_no_fingerprint_is_named_as_such(impl, exported, tmp_path, case):
    """Metadata under the fingerprint's key that is not JSON, or lacks a tensor's shape, dtype or digest, is not
    compared (it proves nothing): it is named as what it is."""
    entry, says = NO_FINGERPRINT[case]

    def spoil(adapter, base):
        file = adapter / "adapter_model.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, file, metadata={**metadata, "dsv4_base_fingerprint": entry})

    base, adapter = _edited_copies(exported, tmp_path, spoil)
    problems = impl.verify_adapter(base, adapter).problems
    assert any(says in p for p in problems), f"{case}: not named: {problems}"
    assert not any(UNCHECKED in p for p in problems), f"{case}: a check stumbled over it: {problems}"


@pytest.mark.parametrize("dims", [1, 3])
def test_a_lora_half_that_is_not_two_dimensional_is_named_with_its_shape(impl, exported, tmp_path, dims):
    """Even one whose leading dimensions agree with [r, in]: a 1-D lora_A of length r, a 3-D one [r, in, 1]."""
    out_f, in_f = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    shape = [R, in_f, 1][:dims]
    module = "model.layers.0.self_attn.q_a_proj"
    halves = {
        f"base_model.model.{module}.lora_A.weight": torch.zeros(shape),
        f"base_model.model.{module}.lora_B.weight": torch.zeros(out_f, R),
    }
    result = impl.verify_adapter(exported[0], _peft_adapter(tmp_path / "a", {}, ["q_a_proj"], halves))
    want = f"{module}.lora_A: shape {shape}, expected [r={R}, in={in_f}]"
    assert any(p.startswith(want) for p in result.problems), f"the {dims}-D lora_A is not named: {result.problems}"


def test_a_third_party_adapter_is_validated_without_a_base_by_what_target_modules_selects(impl, exported, tmp_path):
    """Without a base, a third-party adapter's target_modules can only be held to covering its own modules: one
    that selects them all passes, one that leaves a module out is refused naming it."""
    shape = _base_shape(exported[0], "layers.0.attn.wq_a.weight")
    q_a = "model.layers.0.self_attn.q_a_proj"
    covered = _peft_adapter(tmp_path / "covered", {q_a: shape}, ["q_a_proj"])
    assert impl.validate_adapter_dir(covered, require_complete=False)["modules"] == [q_a]
    kv = "model.layers.0.self_attn.kv_proj"
    uncovered = _peft_adapter(tmp_path / "uncovered", {q_a: shape, kv: shape}, ["q_a_proj"])
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
    shape = _base_shape(base, "layers.0.attn.wq_a.weight")  # the kind is judged by the name, whatever the shape
    modules = {"layers.0.attn.wq_a": shape, module: shape}
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["wq_a", module.rsplit(".", 1)[-1]]))
    said = [p for p in result.problems if p.startswith(f"1 modules are {kind} modules ({leaf})")]
    assert said and module in said[0], f"{module}: not named a {kind} module: {result.problems}"
    assert not any(UNCHECKED in p for p in result.problems), f"{module}: a check stumbled: {result.problems}"


def test_a_lora_on_a_one_dimensional_base_weight_is_named_as_no_weight_lora_adapts(impl, exported, tmp_path):
    base = exported[0]
    (hidden,) = _base_shape(base, "layers.0.attn_norm.weight")
    adapter = _peft_adapter(tmp_path / "a", {"layers.0.attn_norm": (hidden, hidden)}, ["attn_norm"])
    want = f"layers.0.attn_norm: the base weight layers.0.attn_norm.weight has shape [{hidden}], not a 2-D weight"
    problems = impl.verify_adapter(base, adapter).problems
    assert any(p.startswith(want) for p in problems), f"the norm's 1-D weight is not named: {problems}"


def test_a_dora_adapter_is_one_line_counting_its_magnitude_vectors(impl, exported, tmp_path):
    """DoRA's delta is no s*B@A: the config line says so once, with how many magnitude vectors it carries."""
    base = exported[0]
    out_f, in_f = _base_shape(base, "layers.0.attn.wq_a.weight")
    modules = {f"model.layers.{i}.self_attn.q_a_proj": (out_f, in_f) for i in range(2)}
    magnitudes = {f"base_model.model.{m}.lora_magnitude_vector": torch.ones(out_f) for m in modules}
    adapter = _peft_adapter(tmp_path / "a", modules, list(modules), magnitudes, use_dora=True)
    said = [p for p in impl.verify_adapter(base, adapter).problems if "use_dora=True" in p]
    assert len(said) == 1 and "(2 lora_magnitude_vector tensors)" in said[0], f"the DoRA lines: {said}"


def test_a_list_target_modules_selects_its_leaves_on_every_layer_as_peft_does(impl, exported, tmp_path):
    """PEFT matches a transformers adapter's list of names as suffixes of every module path: ``["q_a_proj"]`` wraps
    that projection on every layer, so an adapter with tensors for layer 0 only leaves the others wrapped empty."""
    base = exported[0]
    modules = {"model.layers.0.self_attn.q_a_proj": _base_shape(base, "layers.0.attn.wq_a.weight")}
    result = impl.verify_adapter(base, _peft_adapter(tmp_path / "a", modules, ["q_a_proj"]))
    others = get_preset(PRESET).num_hidden_layers - 1
    want = f"{others} modules target_modules also selects have no tensors in the adapter, e.g. model.layers.1."
    assert any(p.startswith(want) for p in result.problems), f"the layers the list also selects: {result.problems}"


def test_the_fingerprint_row_says_which_weights_were_compared_by_their_sampled_pages(impl, tmp_path, monkeypatch):
    """A large weight whose digest is not remembered is compared by its sampled pages, and the row says how many
    were (``--full-hash``: every byte of every one)."""
    monkeypatch.setenv("DSV4_LORA_CACHE", "off")  # nothing remembered from an earlier run
    config = get_preset(PRESET)
    config.q_lora_rank = SAMPLED_ABOVE // (4 * config.hidden_size) + 1  # fp32 wq_a [q_lora, hidden] and wq_b: large
    base = write_checkpoint(config, tmp_path / "base", seed=2)
    adapter = export_fingerprinted_adapter(impl, base, tmp_path / "adapter", config, r=R, alpha=ALPHA)
    layers = config.num_hidden_layers

    def row(**options):
        return next(c.figure for c in impl.verify_adapter(base, adapter, **options).checks if c.name == "fingerprint")

    sampled = re.fullmatch(r"matches the base \((\d+) tensors by every byte, (\d+) by \d+ sampled pages: .*\)", row())
    assert sampled and sampled.groups() == (str(3 * layers), str(2 * layers)), f"the sampled row: {row()}"
    assert row(full_hash=True) == f"matches the base (every byte of {5 * layers} tensors)"


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_lora_a_narrower_or_wider_than_the_base_weights_input_is_named(impl, exported, tmp_path, extra):
    base = exported[0]
    out_f, in_f = _base_shape(base, "layers.0.attn.wq_a.weight")
    module = "model.layers.0.self_attn.q_a_proj"
    adapter = _peft_adapter(tmp_path / "a", {module: (out_f, in_f + extra)}, ["q_a_proj"])
    want = f"{module}.lora_A: shape [{R}, {in_f + extra}], expected [r={R}, in={in_f}]"
    problems = impl.verify_adapter(base, adapter).problems
    assert any(p.startswith(want) for p in problems), f"lora_A {in_f + extra} wide is not named: {problems}"


def test_a_rank_one_adapter_is_sound(impl, exported, tmp_path):
    """r = 1 is the smallest rank PEFT builds, and a valid one."""
    module = "model.layers.0.self_attn.q_a_proj"
    modules = {module: _base_shape(exported[0], "layers.0.attn.wq_a.weight")}
    adapter = _peft_adapter(tmp_path / "a", modules, re.escape(module), r=1)
    result = impl.verify_adapter(exported[0], adapter)
    assert result.ok, f"a rank-1 adapter is refused: {result.problems}"
