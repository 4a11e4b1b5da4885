"""What a consumer verdict covers, as docs/loading.md states it: ``vllm`` stands for every vLLM platform with LoRA
support (``vllm/nvidia`` and ``vllm/xpu``), each judged by its own rules; and a target no rule covers is never
vouched for, so it fails the verdict like a target the engine would not apply."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu

VLLM_LORA_PLATFORMS = {"vllm/nvidia", "vllm/xpu"}  # docs/loading.md: "vllm means vLLM's platforms with LoRA support"


def test_vllm_is_judged_on_every_platform_with_lora_support(impl):
    # 0.33.0: the release where neither LoRA platform applies wo_a, so each platform's rule shows in the verdict
    verdict = impl.consumer_verdict("vllm", "official", ["wo_a"], "0.33.0")
    judged = {rule.consumer for rule in verdict.not_applied}
    assert judged == VLLM_LORA_PLATFORMS, f"vllm's wo_a verdict names the platforms {sorted(judged)}"
    problems = "\n".join(verdict.problems())
    missing = [platform for platform in sorted(VLLM_LORA_PLATFORMS) if platform not in problems]
    assert not missing, f"the verdict's problem lines do not name {missing}:\n{problems}"


def test_a_target_without_a_rule_is_never_vouched_for(impl):
    """PEFT's rules for the transformers dialect hold no MTP row (transformers has no MTP layer), so nothing says
    PEFT applies an MTP target there; the applied targets beside it do not make the verdict pass."""
    assert impl.consumer_verdict("peft", "transformers", ["wq_a"]).ok, "the control: wq_a alone is applied"
    verdict = impl.consumer_verdict("peft", "transformers", ["wq_a", "mtp"])
    assert not verdict.ok, "an adapter with a target no rule covers was vouched for"
    assert any("mtp" in line for line in verdict.problems()), verdict.problems()
