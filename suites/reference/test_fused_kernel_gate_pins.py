"""#4338 / #4445: our fused-kernel gate next to the installed Megatron-Bridge pin's, on the same simulated hardware.

Per simulated host (no CUDA, A100, H100, B200, sm120; with and without the DSA kernel packages) our answer is stated
by :data:`OURS` (the specification), then compared with the pin's own answer: its
``deepseek_v4_supports_blackwell_fused_kernels`` and the ``use_fused_mhc`` / ``apply_dsa_kernel_fusion`` its
``DeepSeekV4Bridge.provider_bridge`` sets when Megatron-Bridge's AutoBridge builds a provider for a V4 config.
Every disagreement must be a row of :data:`DELIBERATE` (with its reason), and every row must still disagree.
"""

import importlib
import importlib.metadata
import importlib.util

import pytest

from fixtures.data.simulated_accelerators import HARDWARE, simulate_hardware
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PIN = importlib.metadata.version("megatron-bridge")
UPSTREAM_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"
FIELDS = ("use_fused_mhc", "apply_dsa_kernel_fusion")
BLACKWELL = {"b200", "rtx-pro-6000"}

#: (hardware, DSA kernels installed) -> (use_fused_mhc, apply_dsa_kernel_fusion) we answer
OURS = {(hw, kernels): (hw in BLACKWELL, hw in BLACKWELL and kernels) for hw in HARDWARE for kernels in (False, True)}

NO_CUDA_TRUE = (
    "0.5.x answers True without CUDA (#4338 as released); we follow #4445 (0.6): a host without CUDA cannot run "
    "Blackwell kernels, and a CPU-built recipe must not carry them to the cluster by accident"
)
NO_KERNEL_CHECK = (
    "0.5.x enables DSA fusion on any Blackwell host; we follow #4445 (0.6), which also requires cuDNN's DSA and "
    "FlashMLA's sparse forward to import"
)
#: (pin prefix, hardware, kernels or None for both, field) -> why we differ from that pin on purpose
DELIBERATE = {
    **{("0.5.", "no-cuda", k, f): NO_CUDA_TRUE for k in (False, True) for f in (*FIELDS, "blackwell_gate")},
    **{("0.5.", hw, False, "apply_dsa_kernel_fusion"): NO_KERNEL_CHECK for hw in BLACKWELL},
}


def _deliberate(hardware: str, kernels: bool, field: str) -> str | None:
    for (pin, hw, k, f), why in DELIBERATE.items():
        if PIN.startswith(pin) and (hw, k, f) == (hardware, kernels, field):
            return why
    return None


def _upstream():
    if importlib.util.find_spec(UPSTREAM_MODULE) is None:
        pytest.skip(f"megatron-bridge {PIN} has no DeepSeek-V4 gate (first released in 0.5.0)")
    return importlib.import_module(UPSTREAM_MODULE)


def _compare(field: str, hardware: str, kernels: bool, ours: bool, theirs: bool) -> None:
    why = _deliberate(hardware, kernels, field)
    where = f"megatron-bridge {PIN} on {hardware} ({'with' if kernels else 'without'} DSA kernels), {field}"
    if why:
        assert ours != theirs, f"{where}: documented difference closed (both {ours}); drop it from DELIBERATE: {why}"
    else:
        assert ours == theirs, f"{where}: ours {ours}, Megatron-Bridge {theirs}"


@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_our_blackwell_gate_next_to_the_pins_on_the_same_hardware(impl, monkeypatch, hardware):
    upstream = _upstream()
    simulate_hardware(monkeypatch, hardware, dsa_kernels=False)
    ours = impl.deepseek_v4_supports_blackwell_fused_kernels()
    assert ours is OURS[hardware, False][0], f"{hardware}: our gate says {ours}"
    theirs = upstream.deepseek_v4_supports_blackwell_fused_kernels()
    _compare("blackwell_gate", hardware, False, ours, theirs)


@pytest.mark.parametrize("kernels", [False, True], ids=["no-dsa-kernels", "dsa-kernels"])
@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_our_fused_defaults_next_to_the_pins_provider_on_the_same_hardware(impl, monkeypatch, hardware, kernels):
    _upstream()
    from megatron.bridge import AutoBridge  # after impl's compat layer (the impl fixture)

    simulate_hardware(monkeypatch, hardware, dsa_kernels=kernels)
    defaults = impl.fused_kernel_defaults()
    ours = tuple(getattr(defaults, f) for f in FIELDS)
    assert ours == OURS[hardware, kernels], f"{hardware}, kernels={kernels}: our defaults {ours}"
    provider = AutoBridge.from_hf_config(get_preset("tiny-mixed")).to_megatron_provider(load_weights=False)
    for field, mine in zip(FIELDS, ours, strict=True):
        _compare(field, hardware, kernels, mine, bool(getattr(provider, field)))
