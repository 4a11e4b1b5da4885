"""A DeepSeek-V4 config through Megatron-Bridge's own provider dispatch, to the native provider.

``AutoBridge.from_hf_config(config).to_megatron_provider()`` asks ``get_model_bridge(architecture)``, keyed on the
architecture name only, so which bridge answers depends on the pin (:func:`provider_through_megatron_bridge`).
"""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)
from impl.errors import ProviderDispatchError

# isort: split

import importlib.metadata
from typing import Any

from megatron.bridge.models.conversion import model_bridge as _mb

from impl.bridge.bridge import SOURCE, DeepseekV4ConversionBridge
from impl.conversion.detect import require_deepseek_v4_config

__all__ = [
    "provider_through_megatron_bridge",
]


def provider_through_megatron_bridge(hf_config: Any) -> Any:
    """The provider Megatron-Bridge's own dispatch (``AutoBridge``) builds for ``hf_config``: the native provider
    where the pin dispatches V4 to our bridge, else :class:`ProviderDispatchError` naming the bridge it reaches.

    * no upstream V4 bridge (0.4.x): the lookup reaches :class:`~impl.bridge.bridge.DeepseekV4ConversionBridge`,
      whose ``provider_bridge`` returns :class:`~impl.native.provider.DeepseekV4NativeProvider`;
    * an upstream ``DeepSeekV4Bridge`` (0.5.0+): the lookup keeps reaching it, on purpose (it builds upstream
      Megatron-Core's ``dsv4_hybrid`` GPTModel for the users of that model), so no dispatch reaches ours and this
      says so."""
    require_deepseek_v4_config(hf_config)
    reached = type(_mb.get_model_bridge(SOURCE))
    if reached is not DeepseekV4ConversionBridge:
        pin = importlib.metadata.version("megatron-bridge")
        raise ProviderDispatchError(
            f"megatron-bridge {pin} dispatches {SOURCE} to {reached.__module__}.{reached.__name__}, which builds "
            "upstream Megatron-Core's dsv4_hybrid GPTModel (Megatron-LM dev and Transformer Engine required); this "
            "implementation leaves that entry in place so AutoBridge users of the upstream model are unaffected, "
            "so no Megatron-Bridge dispatch reaches the native provider here. Build the native model with "
            "impl.build_native_model(hf_config, ...) or impl.DeepseekV4NativeProvider(hf_config=...)."
        )
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_config(hf_config).to_megatron_provider(load_weights=False)
