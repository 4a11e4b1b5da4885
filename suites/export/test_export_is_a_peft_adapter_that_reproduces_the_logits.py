"""The export is a PEFT adapter of exactly the requested targets that reproduces the trained model, at every layout.

Judged from the directory alone (``dsv4_conformance.judge``): safetensors and a LoRA ``adapter_config.json``, PEFT's
key form, every requested target in every layer and nothing else, ``target_modules`` that PEFT's own matcher turns
onto no indexer or compressor module and onto every adapted module, shapes that fit the base, the trained scale,
finite values, the declared success marker. Then PEFT itself loads it onto transformers' model of the base, takes
every tensor of the file, and the merged model's logits equal the implementation's, within the float32 rule held
below the effect of any one module's delta (one target in one layer), measured in the same run.
"""

from __future__ import annotations

import pytest

from dsv4_conformance.judge.artifacts import Expected, judge_adapter_dir
from dsv4_conformance.judge.oracle import LOGIT_RULE, base_model, least_effect, max_abs, peft_logits, read_adapter
from fixtures.conformance.plugin import TRAIN_LAYOUTS, TRAINED_MARKS
from fixtures.conformance.programs import fixed_batch

pytestmark = [pytest.mark.cpu, *TRAINED_MARKS]


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_every_export_is_a_valid_adapter_of_the_requested_targets(trained, layout, conformance_base, driver):
    run = trained(layout)
    lora = run["lora"]
    expected = Expected(lora.targets, lora.rank, lora.alpha)
    for export in ("step1", "step2", "final"):
        problems = judge_adapter_dir(
            run["out"] / export, conformance_base, expected=expected, marker=driver.success_marker
        )
        assert not problems, f"{layout}, export {export}:\n" + "\n".join(map(str, problems))


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_peft_reloads_the_export_and_reproduces_the_trained_logits(trained, layout, conformance_base):
    run = trained(layout)
    import torch

    assert run["logits"] is not None, f"{layout}: rank 0 returned no logits"
    got = torch.from_numpy(run["logits"])
    ids, _ = fixed_batch(str(conformance_base), run["case"].seed)
    adapter_dir = run["out"] / "final"
    unreadable = [p for p in judge_adapter_dir(adapter_dir, conformance_base) if p.check in ("files", "format")]
    assert not unreadable, f"{layout}: PEFT cannot even read the export: {unreadable[0]}"
    want = peft_logits(conformance_base, adapter_dir, ids)
    tolerance = LOGIT_RULE.tolerance(want)
    adapter, scale = read_adapter(adapter_dir)
    power = least_effect(base_model(conformance_base), ids, adapter, scale)
    assert power.exceeds(tolerance), f"the tolerance {tolerance:.2e} hides {power.module}'s delta ({power.effect:.2e})"
    diff = max_abs(got, want)
    assert diff <= tolerance, (
        f"{layout}: max|logits - PEFT reload's| = {diff:.3e} > {tolerance:.3e} (the least module's delta moves them "
        f"{power.effect:.2e}: {power.module})"
    )
