"""Per Megatron-Bridge pin: which bridge serves which model class through Megatron-Bridge's real dispatch.

The installed pin is read from package metadata (scripts/run_pin.sh puts an overlay in front of .venv). Whether
the pin ships an upstream DeepSeek-V4 bridge (0.5.0+) is detected, never looked up by version: that decides
what our registration must preserve. test_bridge_registration.py covers the pins that have an upstream bridge
(it imports it); this file states the dispatch for every pin, including 0.4.x, where ours is the only one.
"""

import importlib.metadata
import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.cpu

SOURCE = "DeepseekV4ForCausalLM"
UPSTREAM_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"
PIN = importlib.metadata.version("megatron-bridge")


def _upstream_module():
    if importlib.util.find_spec(UPSTREAM_MODULE) is None:
        return None
    return importlib.import_module(UPSTREAM_MODULE)


@pytest.fixture
def mb(impl):
    from megatron.bridge.models.conversion import model_bridge  # after impl installed the TE stub

    return model_bridge


@pytest.fixture
def upstream(impl):
    """Upstream DeepSeekV4Bridge of this pin, or None when the pin predates it."""
    module = _upstream_module()
    return None if module is None else module.DeepSeekV4Bridge


def _served_by(monkeypatch, mb, target, bridges) -> type | None:
    """The bridge class Megatron-Bridge's stream dispatcher reaches for (SOURCE, target); None when none is registered."""
    dispatcher = mb.stream_weights_megatron_to_hf
    for cls in bridges:
        monkeypatch.setattr(cls, dispatcher._name, lambda self, *a, **k: type(self))
    try:
        return dispatcher((SOURCE, target), None, None)
    except NotImplementedError:
        return None


def test_the_installed_pin_is_the_one_requested():
    """Guards the overlay: DSV4_BRIDGE_PIN (set by scripts/run_pin.sh and tox) names the megatron-bridge imported."""
    wanted = os.environ.get("DSV4_BRIDGE_PIN")
    if not wanted:
        pytest.skip("DSV4_BRIDGE_PIN unset: running against .venv's own megatron-bridge")
    assert PIN == wanted, f"DSV4_BRIDGE_PIN={wanted} but megatron-bridge {PIN} is imported; check PYTHONPATH"


def test_get_model_bridge_is_upstream_when_the_pin_has_one_else_ours(impl, mb, upstream):
    """AutoBridge keeps the upstream V4 bridge (>= 0.5.0); on older pins ours is the only V4 entry."""
    expected = upstream or impl.DeepseekV4ConversionBridge
    got = type(mb.get_model_bridge(SOURCE))
    assert got is expected, f"megatron-bridge {PIN}: get_model_bridge({SOURCE!r}) -> {got.__name__}"


def test_native_model_is_served_by_our_bridge_under_every_pin(impl, mb, upstream, monkeypatch):
    bridges = [impl.DeepseekV4ConversionBridge] + ([upstream] if upstream else [])
    got = _served_by(monkeypatch, mb, impl.DeepseekV4NativeModel, bridges)
    assert got is impl.DeepseekV4ConversionBridge, f"megatron-bridge {PIN}: native model served by {got}"


def test_gpt_model_is_served_by_upstream_or_by_nothing(impl, mb, upstream, monkeypatch):
    """Our registration never claims GPTModel: upstream serves it where it exists, otherwise dispatch has no entry."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    bridges = [impl.DeepseekV4ConversionBridge] + ([upstream] if upstream else [])
    got = _served_by(monkeypatch, mb, GPTModel, bridges)
    assert got is upstream, f"megatron-bridge {PIN}: ({SOURCE}, GPTModel) served by {got}, expected {upstream}"


def test_our_blackwell_gate_differs_from_upstream_only_where_upstream_says_true_without_cuda(impl, upstream):
    """Documented fact: 0.5.x's own gate returns True without CUDA (#4338), 0.6.x returns False; ours follows CUDA."""
    if torch.cuda.is_available():
        pytest.skip("the difference is about hosts without CUDA")
    helper = getattr(_upstream_module(), "deepseek_v4_supports_blackwell_fused_kernels", None) if upstream else None
    if helper is None:
        pytest.skip(f"megatron-bridge {PIN} has no upstream deepseek_v4_supports_blackwell_fused_kernels")
    ours, theirs = impl.deepseek_v4_supports_blackwell_fused_kernels(), helper()
    assert ours is False, "our gate must say no fused Blackwell kernels without CUDA"
    # Which pins disagree is recorded here as observed, not derived from our output.
    upstream_says_true_without_cuda = PIN.startswith("0.5.")
    assert (ours != theirs) is upstream_says_true_without_cuda, (
        f"megatron-bridge {PIN}: upstream gate says {theirs} without CUDA, ours says {ours}"
    )
