"""Local-spec MLA fix: megatron-core's ``MLASelfAttention`` passes ``k_channels``/``v_channels`` to its
core attention, which only TE's ``TEDotProductAttention`` accepts. The local ``DotProductAttention``
otherwise copes with q/k head dim != v head dim; only its output width must follow ``v_channels``.
"""

from __future__ import annotations

import inspect

_INSTALLED = False


def needs_fix() -> bool:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters


def install_if_needed() -> bool:
    """Patch the local attention when upstream lacks ``k_channels``. Returns True when patched."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if not needs_fix():
        return False
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    __init__.__wrapped__ = original
    DotProductAttention.__init__ = __init__
    _INSTALLED = True
    return True
