"""Which Megatron-Bridge bridge serves which model class, through Megatron-Bridge's own dispatch."""

import pytest

pytestmark = pytest.mark.cpu


@pytest.fixture
def mb(impl):
    from megatron.bridge.models.conversion import model_bridge  # after impl installed the TE stub

    return model_bridge


def _bridge_behind(monkeypatch, dispatcher, key, *bridges):
    """Run Megatron-Bridge's real dispatch; the bridge method it reaches reports its class instead of converting."""
    method = dispatcher._name
    for cls in bridges:
        monkeypatch.setattr(cls, method, lambda self, *a, **k: type(self))
    args = (None,) if method == "stream_adapter_weights_megatron_to_hf" else (None, None)
    return dispatcher(key, *args)


def test_stream_dispatch_reaches_our_bridge_for_the_native_model(impl, mb, monkeypatch):
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge

    key = ("DeepseekV4ForCausalLM", impl.DeepseekV4NativeModel)
    ours = impl.DeepseekV4ConversionBridge
    assert (
        _bridge_behind(monkeypatch, mb.stream_weights_megatron_to_hf, key, ours, DeepSeekV4Bridge)
        is impl.DeepseekV4ConversionBridge
    )
    assert (
        _bridge_behind(monkeypatch, mb.stream_adapter_weights_megatron_to_hf, key, ours, DeepSeekV4Bridge)
        is impl.DeepseekV4ConversionBridge
    )


def test_upstream_bridge_keeps_serving_gpt_model(impl, mb, monkeypatch):
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge
    from megatron.core.models.gpt.gpt_model import GPTModel

    assert (
        _bridge_behind(
            monkeypatch,
            mb.stream_weights_megatron_to_hf,
            ("DeepseekV4ForCausalLM", GPTModel),
            impl.DeepseekV4ConversionBridge,
            DeepSeekV4Bridge,
        )
        is DeepSeekV4Bridge
    )
    assert type(mb.get_model_bridge("DeepseekV4ForCausalLM")) is DeepSeekV4Bridge, "AutoBridge would get ours"


def test_our_provider_bridge_hands_v4_to_the_native_provider_and_refuses_anything_else(impl):
    from tiny_models.presets import get_preset

    cfg = get_preset("tiny-mixed")
    assert isinstance(impl.DeepseekV4ConversionBridge().provider_bridge(cfg), impl.DeepseekV4NativeProvider)
    with pytest.raises(impl.NotDeepseekV4Error):
        impl.DeepseekV4ConversionBridge().provider_bridge(None)
