"""The one place where this project adapts the Megatron stack to a CPU-only host.

Each piece is inactive when the real thing exists; :func:`install` applies them in the order that matters and is
idempotent. A Transformer Engine that is installed but does not import is reported as
:class:`TransformerEngineImportError` with its cause, never left to a silent fallback. ``megatron_bridge`` holds every
access to a Megatron-Bridge private attribute, so the rest of ``impl`` uses its public surface only."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from impl.compat import cpu, mla, te_stub
from impl.errors import BridgeImportError, TransformerEngineImportError

__all__ = [
    "CompatReport",
]


@dataclass(frozen=True)
class CompatReport:
    te_stub: bool
    cpu_shims: bool
    mla_fix: bool


_REPORT: CompatReport | None = None


def install() -> CompatReport:
    """Make megatron-core and megatron-bridge usable on this host; return what was activated.

    Three pieces, each inactive when the real thing exists:

    | piece | active when | what it does |
    |---|---|---|
    | ``te_stub`` | ``transformer_engine`` cannot be imported | import-only stand-in so ``megatron.bridge`` imports; |
    |  |  | using any class raises ``TransformerEngineStubError`` |
    | ``cpu`` | ``torch.cuda.is_available()`` is False | CPU replacements for megatron-core's hard-coded CUDA device |
    |  |  | and RNG calls |
    | ``mla`` | the local ``DotProductAttention`` rejects ``k_channels`` | accepts ``k_channels``/``v_channels`` as |
    |  |  | TE's attention does (megatron-core local-spec MLA bug) |

    Megatron-core is imported first, so its own ``HAVE_TE`` probes see the truth; ``megatron.training`` is imported
    first too when it exists (source-built containers may lack it; nothing here needs it). A Transformer Engine that
    is installed but does not import (wrong CUDA or torch ABI) raises :class:`TransformerEngineImportError`:
    megatron-core would otherwise fall back silently and Megatron-Bridge fail later on an unrelated-looking import.
    ``megatron_bridge`` is not a stand-in. Why each piece exists: ``docs/reference/cpu_environment.md``.
    """
    global _REPORT
    if _REPORT is not None:
        return _REPORT
    if te_stub.real_te_available():  # before megatron-core, whose own TE probes would fail obscurely
        _require_real_te()
    import megatron.core  # noqa: F401  (must precede the TE stub)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    _import_optional("megatron.training")
    if importlib.util.find_spec("modelopt") is not None:
        # Bridge 0.4's AutoBridge imports ModelOpt, whose Megatron plugin registers TE layers when TE imports;
        # it must see no TE rather than the stub's placeholders (megatron.training, when present, imports it first).
        importlib.import_module("modelopt.torch.quantization")
    stub = te_stub.install_if_absent()
    shims = cpu.install_if_no_cuda()
    fix = mla.install_if_needed()
    if stub:
        # megatron.bridge.peft.utils probes TE with isinstance(); placeholders are not TE types. (Bridge 0.6.2
        # itself imports megatron.training; without it Bridge fails on its own import, naming that module.)
        peft_utils = _import_bridge("megatron.bridge.peft.utils")
        if peft_utils is not None:
            peft_utils.HAVE_TE = False
    _REPORT = CompatReport(te_stub=stub, cpu_shims=shims, mla_fix=fix)
    return _REPORT


#: what a source-built container may lack; its absence is not an error for the compat layer
_OPTIONAL = "megatron.training"


def _import_optional(name: str) -> Any:
    """Import ``name``; None when that fails only because :data:`_OPTIONAL` is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == _OPTIONAL or missing.startswith(_OPTIONAL + ".") or _OPTIONAL.startswith(missing + "."):
            return None
        raise


def _import_bridge(name: str) -> Any:
    """:func:`_import_optional` for a Megatron-Bridge module; a transformers module it needs that this
    transformers lacks is a :class:`BridgeImportError` saying which versions meet."""
    try:
        return _import_optional(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing.startswith("transformers."):
            raise
        from importlib.metadata import version

        raise BridgeImportError(
            f"megatron-bridge {version('megatron-bridge')} does not import under transformers "
            f"{version('transformers')} (it imports {missing}, which this transformers lacks); install a "
            "transformers CI ran it with (README's version table)"
        ) from exc


def _require_real_te() -> None:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, OSError (missing libcudart), RuntimeError (ABI checks)
        raise TransformerEngineImportError(
            f"transformer_engine is installed but does not import ({type(exc).__name__}: {exc}). Megatron-Bridge "
            "imports it unconditionally. Reinstall a Transformer Engine built for this torch and CUDA, or "
            "uninstall it on a CPU host (impl then uses its import stub)."
        ) from exc
