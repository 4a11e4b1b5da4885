"""Every use of a Megatron-Bridge private attribute, by name, in one place.

The rest of ``impl`` calls these functions instead of reaching into Megatron-Bridge objects, so a pin that renames
one of them breaks here, in a function named for what it does. Each was read in Megatron-Bridge 0.6.2; the pin
matrix (``scripts/run_pin.sh``) shows whether other pins still have it. Nothing here imports ``megatron.bridge`` at
module level: the CPU compat layer must be installed first."""

from __future__ import annotations

from typing import Any

__all__ = [
    "adapter_enabled",
    "detect_parallelism",
    "registered_model_bridge",
    "replicate_over_tensor_parallel",
    "restore_model_bridge",
]


def _model_bridge_dispatch() -> Any:
    from megatron.bridge.models.conversion import model_bridge

    return model_bridge.get_model_bridge


def registered_model_bridge(source: str) -> Any | None:
    """The ``get_model_bridge`` entry registered for ``source`` (an architecture name), or None.

    ``get_model_bridge`` is a ``models.decorators.dispatch._Dispatch``; its table ``_exact_types`` has no accessor.
    """
    return _model_bridge_dispatch()._exact_types.get(source)


def restore_model_bridge(source: str, entry: Any) -> None:
    """Put ``entry`` back as ``get_model_bridge``'s answer for ``source`` and drop the dispatcher's cached answers
    (``_dispatch_cache``), which would otherwise keep serving the replaced entry."""
    dispatch = _model_bridge_dispatch()
    dispatch._exact_types[source] = entry
    dispatch._dispatch_cache.clear()


def replicate_over_tensor_parallel(mapping: Any) -> Any:
    """Make a ``MegatronParamMapping`` treat its module as replicated: with no TP group (``_tp_group``, set from
    parallel state in its constructor) it has tp_size 1, so gated mappings concatenate / split without scattering."""
    mapping._tp_group = None
    return mapping


def detect_parallelism(mapping: Any, module: Any) -> str:
    """What ``AutoMapping`` decides for ``module``: ``"column"``, ``"row"`` or ``"replicated"`` (its private
    ``_detect_parallelism_type``; the public path only uses the answer inside a transfer)."""
    return mapping._detect_parallelism_type(module)


def adapter_enabled(wrapper: Any) -> bool:
    """Whether an ``AdapterWrapper``'s adapter contributes to its output (``enable_adapter_layers`` /
    ``disable_adapter_layers`` set ``_adapter_enabled``; there is no getter)."""
    return bool(wrapper._adapter_enabled)
