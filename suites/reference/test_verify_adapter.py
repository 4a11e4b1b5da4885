"""``verify-adapter``'s checks through the public ``verify_adapter``: an exported adapter against its base passes, and
each spoilt adapter or base is reported with the tensor or file that is wrong. The same cases run through the command
line after a full ``qualify`` in ``test_cli``; here a tiny base and an exported adapter suffice, so they are fast.
A third-party adapter is judged by what each module it wraps is, in any naming: main attention, MTP, an off-target
kind, or nothing of a V4 base."""

from __future__ import annotations

import json
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


def _peft_adapter(path, modules, target_modules, extra=None):
    """A third-party PEFT adapter at ``path``: lora_A [R, in] and lora_B [out, R] for each module path -> (out, in),
    the tensors ``extra`` beside them, and an ``adapter_config.json`` with ``target_modules``."""
    tensors = dict(extra or {})
    for module, (out_f, in_f) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.full((R, in_f), 0.01)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.full((out_f, R), 0.01)
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "r": R, "lora_alpha": ALPHA}
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": target_modules}))
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
