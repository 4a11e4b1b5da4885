"""Reference implementation: LoRA on DeepSeek-V4 with Megatron-Core and Megatron-Bridge.

Public API (what the suites reach through the ``impl`` fixture) is listed in ``__all__``.
Importing this package makes the Megatron stack usable on this host (``impl.compat``).
"""

from impl.compat import install as _install_compat

_install_compat()

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
