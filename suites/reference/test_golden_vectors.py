"""The golden vectors (``golden/v1/``, ``scripts/golden_vectors.py``) are what PEFT on transformers computes, hold
one adapter under three namings, and have power: the defects they claim to catch miss them by far more than the
tolerance, measured here.

The expected vectors are recomputed here a second way: projections through PEFT's merged weights, attention blocks
called by ``DeepseekV4ForCausalLM``'s own forward (a pre-hook hands each layer's ``self_attn`` the golden input, a
hook keeps its output), not by the generator's harness.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.runner.subproc import REPO_ROOT
from tiny_models import golden as g
from tiny_models.oracle import load_oracle

pytestmark = pytest.mark.cpu

GOLDEN = REPO_ROOT / "golden" / "v1"
TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
LAYERS = (0, 1, 2)
#: each naming's module path, written from the published facts (transformers' module tree; the official
#: checkpoint's names; SGLang's module tree with the checkpoint's leaves)
TRANSFORMERS_LEAF = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
NAMING_PATHS = {
    "transformers": lambda n, t: f"model.layers.{n}.self_attn.{TRANSFORMERS_LEAF[t]}",
    "official": lambda n, t: f"layers.{n}.attn.{t}",
    "sglang": lambda n, t: f"model.layers.{n}.self_attn.{t}",
}
UNITS32 = 256  # the rule golden/v1/README.md states, in units of eps(float32) × max|expected|
#: a defect the vectors claim to catch must miss them by this many float32 tolerances (measured: over 8,000)
FACTOR32 = 1000
#: and by this many bfloat16 tolerances, on the projections (measured: 17 or more)
FACTOR16 = 10


def _script():
    spec = importlib.util.spec_from_file_location("golden_vectors", REPO_ROOT / "scripts" / "golden_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tolerance(expected: torch.Tensor, units: float = UNITS32, dtype: torch.dtype = torch.float32) -> float:
    return units * torch.finfo(dtype).eps * float(expected.abs().max())


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "expected.safetensors"))


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "inputs.safetensors"))


@pytest.fixture(scope="module")
def base():
    return load_oracle(GOLDEN / "base")


def model_outputs(model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every projection on its golden input, and each layer's attention block as the model's forward calls it."""
    attn, handles = {}, []

    def swap_in(module, args, kwargs):
        assert args, "DeepseekV4DecoderLayer no longer passes hidden_states positionally"
        return (inputs["hidden_states"], *args[1:]), kwargs

    for n, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(swap_in, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, out, n=n: attn.__setitem__(n, out[0])))
    ids = torch.zeros(inputs["position_ids"].shape, dtype=torch.long)
    with torch.no_grad():
        model(ids, position_ids=inputs["position_ids"])
        for h in handles:
            h.remove()
        found = {f"layers.{n}.attn": out for n, out in attn.items()}
        for n, layer in enumerate(model.model.layers):
            for t in TARGETS:
                module = getattr(layer.self_attn, TRANSFORMERS_LEAF[t])
                found[f"layers.{n}.{t}"] = module(inputs[g.INPUT_OF[t]])
    return found


def merged(base, adapter_dir: Path):
    """PEFT's reload of the adapter (every tensor taken as stored), merged into the base's weights."""
    return g.peft_model(base, adapter_dir).merge_and_unload().eval()


def test_the_committed_files_are_what_the_generator_writes(tmp_path):
    script = _script()
    script.generate(tmp_path / "v1")
    assert script.compare(GOLDEN, tmp_path / "v1") == [], "run .venv/bin/python scripts/golden_vectors.py --write"


def test_the_check_sees_a_changed_vector_and_a_changed_adapter(tmp_path, expected):
    """--check's power: a vector replaced by its base output, one factor's byte changed, a file gone."""
    script, copy = _script(), tmp_path / "v1"
    shutil.copytree(GOLDEN, copy)
    changed = dict(expected) | {"wo_a/layers.1.wo_a": expected["base/layers.1.wo_a"].clone()}
    save_file(changed, str(copy / "expected.safetensors"), metadata={"format": "pt"})
    factor = copy / "adapters" / "official" / "wq_b" / g.ADAPTER_FILE
    data = bytearray(factor.read_bytes())
    data[-1] ^= 1
    factor.write_bytes(bytes(data))
    (copy / "adapters" / "sglang" / "wkv" / g.CONFIG_FILE).unlink()
    problems = "\n".join(script.compare(copy, GOLDEN))
    for what in (
        "wo_a/layers.1.wo_a is not within",
        "official/wq_b/adapter_model.safetensors: differs",
        "sglang/wkv/adapter_config.json: missing",
    ):
        assert what in problems, f"--check missed {what!r}:\n{problems}"


@pytest.mark.parametrize("adapter", ["base", *TARGETS])
def test_every_vector_is_peft_on_transformers_within_the_rule(adapter, base, inputs, expected):
    model = base if adapter == "base" else merged(base, GOLDEN / "adapters" / "transformers" / adapter)
    fresh = model_outputs(model, inputs)
    names = [n for n in expected if n.startswith(f"{adapter}/")]
    assert len(names) == len(LAYERS) * (len(TARGETS) + 1 if adapter == "base" else 2), names
    for name in names:
        want, got = expected[name], fresh[name.split("/", 1)[1]]
        delta = float((got - want).abs().max())
        assert got.shape == want.shape and delta <= tolerance(want), (
            f"{name}: max|Δ| {delta:.3g}, {tolerance(want):.3g}"
        )


@pytest.mark.parametrize("target", TARGETS)
def test_each_naming_holds_the_same_factors_under_its_names(target):
    files = {n: load_file(str(GOLDEN / "adapters" / n / target / g.ADAPTER_FILE)) for n in NAMING_PATHS}
    configs = {n: json.loads((GOLDEN / "adapters" / n / target / g.CONFIG_FILE).read_text()) for n in NAMING_PATHS}
    reference = files["transformers"]
    for naming, tensors in files.items():
        names = {
            f"base_model.model.{NAMING_PATHS[naming](n, target)}.lora_{h}.weight": f"base_model.model."
            f"{NAMING_PATHS['transformers'](n, target)}.lora_{h}.weight"
            for n in LAYERS
            for h in "AB"
        }
        assert set(tensors) == set(names), f"{naming}/{target}: {sorted(tensors)}"
        for name, same in names.items():
            assert torch.equal(tensors[name], reference[same]), f"{naming}/{target}: {name} differs"
            assert tensors[name].abs().min() > 0, f"{naming}/{target}: {name} holds zeros"
        assert (configs[naming]["r"], configs[naming]["lora_alpha"]) == (4, 8.0), naming
        assert not configs[naming]["use_rslora"], naming
    assert configs["official"]["target_modules"] == configs["sglang"]["target_modules"] == [target]


@pytest.mark.parametrize("target", TARGETS)
def test_dropping_the_adapter_misses_every_vector_by_far_more_than_the_tolerance(target, expected):
    for n in LAYERS:
        for module in (target, "attn"):
            want, dropped = expected[f"{target}/layers.{n}.{module}"], expected[f"base/layers.{n}.{module}"]
            effect = float((dropped - want).abs().max())
            assert effect >= FACTOR32 * tolerance(want), f"{target}/layers.{n}.{module}: dropping moves {effect:.3g}"
            if module != "attn":
                bf16 = tolerance(want, 4, torch.bfloat16)
                assert effect >= FACTOR16 * bf16, f"{target}/layers.{n}.{module}: {effect:.3g}, bf16 tol {bf16:.3g}"


def test_swapping_two_groups_rows_of_wo_a_lora_b_misses_by_far_more_than_the_tolerance(
    tmp_path, base, inputs, expected
):
    """The grouped semantics: group g takes its own rows of lora_B; an engine that hands group 0's rows to group 1
    (and back) misses the projection and the attention block of every layer."""
    source = GOLDEN / "adapters" / "transformers" / "wo_a"
    tensors, rows = load_file(str(source / g.ADAPTER_FILE)), base.config.o_lora_rank
    for name in [k for k in tensors if k.endswith("lora_B.weight")]:
        b = tensors[name]
        tensors[name] = torch.cat([b[rows : 2 * rows], b[:rows], b[2 * rows :]])
    (tmp_path / "swapped").mkdir()
    save_file(tensors, str(tmp_path / "swapped" / g.ADAPTER_FILE), metadata={"format": "pt"})
    shutil.copy(source / g.CONFIG_FILE, tmp_path / "swapped" / g.CONFIG_FILE)
    fresh = model_outputs(merged(base, tmp_path / "swapped"), inputs)
    for n in LAYERS:
        for module in ("wo_a", "attn"):
            want = expected[f"wo_a/layers.{n}.{module}"]
            effect = float((fresh[f"layers.{n}.{module}"] - want).abs().max())
            assert effect >= FACTOR32 * tolerance(want), f"wo_a/layers.{n}.{module}: swapping moves {effect:.3g}"
