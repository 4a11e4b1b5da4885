"""The one place where this project adapts the Megatron stack to a CPU-only host.

Three pieces, each inactive when the real thing exists:

| piece | active when | what it does |
|---|---|---|
| ``te_stub`` | ``transformer_engine`` cannot be imported | import-only stand-in so ``megatron.bridge`` imports; using any class raises ``TransformerEngineStubError`` |
| ``cpu`` | ``torch.cuda.is_available()`` is False | CPU replacements for megatron-core's hard-coded CUDA device and RNG calls |
| ``mla`` | the local ``DotProductAttention`` rejects ``k_channels`` | accepts ``k_channels``/``v_channels`` as TE's attention does (megatron-core local-spec MLA bug) |

``install()`` applies all three in the order that matters (megatron-core first, so its own
``HAVE_TE`` probes see the truth) and is idempotent. Why each piece exists: ``docs/reference/cpu_environment.md``.

``megatron_bridge`` is not a stand-in: it holds every access to a Megatron-Bridge private attribute, each behind a
named function, so the rest of ``impl`` depends on Megatron-Bridge's public surface only.
"""

from __future__ import annotations

from dataclasses import dataclass

from impl.compat import cpu, mla, te_stub
from impl.compat.te_stub import TransformerEngineStubError

__all__ = ["CompatReport", "TransformerEngineStubError", "install"]


@dataclass(frozen=True)
class CompatReport:
    te_stub: bool
    cpu_shims: bool
    mla_fix: bool


_REPORT: CompatReport | None = None


def install() -> CompatReport:
    """Make megatron-core and megatron-bridge usable on this host; return what was activated."""
    global _REPORT
    if _REPORT is not None:
        return _REPORT
    import megatron.core  # noqa: F401  (must precede the TE stub)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.training  # noqa: F401

    stub = te_stub.install_if_absent()
    shims = cpu.install_if_no_cuda()
    fix = mla.install_if_needed()
    if stub:
        # megatron.bridge.peft.utils probes TE with isinstance(); placeholders are not TE types.
        import megatron.bridge.peft.utils as peft_utils

        peft_utils.HAVE_TE = False
    _REPORT = CompatReport(te_stub=stub, cpu_shims=shims, mla_fix=fix)
    return _REPORT
