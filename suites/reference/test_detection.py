"""Exact DeepSeek-V4 detection, and the hardware gates for fused-kernel defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fixtures.data.simulated_accelerators import simulate_hardware

pytestmark = pytest.mark.cpu

NOT_V4 = {
    "missing": SimpleNamespace(),
    "none": SimpleNamespace(architectures=None),
    "empty": SimpleNamespace(architectures=[]),
    "v3": SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
    "v32": SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32"),
    "lowercase": SimpleNamespace(architectures=["deepseekv4forcausallm"]),
    "suffix": SimpleNamespace(architectures=["DeepseekV4ForCausalLMX"]),
    "prefix": SimpleNamespace(architectures=["MyDeepseekV4ForCausalLM"]),
    "v4-not-first": SimpleNamespace(architectures=["DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM"]),
    "bare-string": SimpleNamespace(architectures="DeepseekV4ForCausalLM"),
    "non-string": SimpleNamespace(architectures=[None]),
}


def test_v4_first_architecture_is_detected(impl):
    assert impl.is_deepseek_v4_config(SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]))
    assert impl.is_deepseek_v4_config({"architectures": ["DeepseekV4ForCausalLM", "Other"]})


def test_transformers_v4_config_is_detected(impl):
    from transformers import DeepseekV4Config

    assert impl.is_deepseek_v4_config(DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"]))


@pytest.mark.parametrize("case", sorted(NOT_V4))
def test_non_v4_configs_are_not_detected(impl, case):
    assert impl.is_deepseek_v4_config(NOT_V4[case]) is False


@pytest.mark.parametrize("case", ["missing", "v3", "suffix", "bare-string"])
def test_require_names_what_was_found(impl, case):
    cfg = NOT_V4[case]
    with pytest.raises(impl.NotDeepseekV4Error, match="DeepseekV4ForCausalLM") as info:
        impl.require_deepseek_v4_config(cfg)
    assert repr(getattr(cfg, "architectures", None)) in str(info.value)


def test_blackwell_gate_is_false_without_cuda(impl, monkeypatch):
    """Regression (#4445): no CUDA means no fused kernels (0.5.0 answered True)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert impl.deepseek_v4_supports_blackwell_fused_kernels() is False
    assert impl.deepseek_v4_supports_fused_dsa_kernels() is False
    assert impl.fused_kernel_defaults() == impl.FusedKernelDefaults(use_fused_mhc=False, apply_dsa_kernel_fusion=False)


@pytest.mark.parametrize(
    ("hardware", "expected"), [("a100", False), ("h100", False), ("b200", True), ("rtx-pro-6000", True)]
)
def test_blackwell_gate_follows_capability_major(impl, monkeypatch, hardware, expected):
    simulate_hardware(monkeypatch, hardware, dsa_kernels=True)
    assert impl.deepseek_v4_supports_blackwell_fused_kernels() is expected
    defaults = impl.fused_kernel_defaults()
    assert defaults.use_fused_mhc is expected and defaults.apply_dsa_kernel_fusion is expected


def test_dsa_fusion_stays_off_on_blackwell_without_its_kernel_packages(impl, monkeypatch):
    """#4445: cuDNN's DSA and FlashMLA's sparse forward must import, or the default would name kernels that do not
    exist on this host; fused mHC does not need them."""
    simulate_hardware(monkeypatch, "b200", dsa_kernels=False)
    assert impl.deepseek_v4_supports_fused_dsa_kernels() is False
    assert impl.fused_kernel_defaults() == impl.FusedKernelDefaults(use_fused_mhc=True, apply_dsa_kernel_fusion=False)
