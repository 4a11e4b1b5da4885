"""The positive path of provider dispatch: Megatron-Bridge's own ``AutoBridge`` hands a DeepSeek-V4 config to the
native provider under every pin where its dispatch reaches our bridge; elsewhere a typed error says why.

Whether a pin can is read from Megatron-Bridge itself (does it ship an upstream V4 bridge, which our registration
deliberately leaves in charge of ``get_model_bridge``), never from our answer.
"""

import importlib.metadata
import importlib.util
import re

import pytest

from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PIN = importlib.metadata.version("megatron-bridge")
UPSTREAM_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"


@pytest.fixture
def auto_bridge(impl):
    """Megatron-Bridge's AutoBridge, with our bridge registered (loading it registers it, as a user's import does)."""
    from megatron.bridge import AutoBridge  # after the impl fixture installed the CPU compat layer

    assert impl.DeepseekV4ConversionBridge.SOURCE_NAME == "DeepseekV4ForCausalLM"
    return AutoBridge


def _pin_ships_a_v4_bridge() -> bool:
    """Looked up after the impl fixture: finding the module imports megatron.bridge, which needs the compat layer."""
    return importlib.util.find_spec(UPSTREAM_MODULE) is not None


def test_autobridge_hands_a_v4_config_to_the_native_provider(impl, auto_bridge):
    if _pin_ships_a_v4_bridge():
        pytest.skip(f"megatron-bridge {PIN} dispatches V4 to its own DeepSeekV4Bridge (the next test)")
    cfg = get_preset("tiny-mixed")
    provider = auto_bridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert isinstance(provider, impl.DeepseekV4NativeProvider), f"megatron-bridge {PIN}: got {type(provider)}"
    assert provider.hf_config is cfg
    provider.finalize()
    assert provider.v4_config.num_layers == cfg.num_hidden_layers, provider.v4_config
    again = impl.provider_through_megatron_bridge(cfg)
    assert isinstance(again, impl.DeepseekV4NativeProvider) and again.hf_config is cfg


def test_where_upstream_keeps_the_dispatch_a_typed_error_names_it_and_why(impl, auto_bridge):
    if not _pin_ships_a_v4_bridge():
        pytest.skip(f"megatron-bridge {PIN} has no upstream V4 bridge: its dispatch reaches ours (the previous test)")
    cfg = get_preset("tiny-mixed")
    remedy = re.escape(f"{impl.name}.build_native_model")  # the entry point of the implementation under test
    with pytest.raises(impl.ProviderDispatchError, match=f"DeepSeekV4Bridge.*{remedy}") as info:
        impl.provider_through_megatron_bridge(cfg)
    assert PIN in str(info.value), str(info.value)
    provider = auto_bridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert not isinstance(provider, impl.DeepseekV4NativeProvider), "the error claims a dispatch that reaches ours"


@pytest.mark.parametrize("arch", [None, ["DeepseekV3ForCausalLM"], ["DeepseekV4ForCausalLMX"]], ids=str)
def test_a_non_v4_config_is_refused_before_any_dispatch(impl, arch):
    cfg = get_preset("tiny-mixed")
    cfg.architectures = arch
    with pytest.raises(impl.NotDeepseekV4Error):
        impl.provider_through_megatron_bridge(cfg)
    with pytest.raises(impl.NotDeepseekV4Error):
        impl.DeepseekV4ConversionBridge().provider_bridge(cfg)
