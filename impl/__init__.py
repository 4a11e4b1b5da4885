"""Reference implementation: LoRA on DeepSeek-V4 with Megatron-Core and Megatron-Bridge.

The public API, what the suites reach through the ``impl`` fixture, is ``__all__``: the ``__all__`` of each module of
:data:`_PUBLIC_MODULES`, read from its source without importing it (:func:`_module_all`). Names load lazily, so
``import impl`` is cheap; every module that imports megatron imports ``impl.compat.active`` first, so nothing can
import megatron ahead of the CPU compatibility layer."""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

#: the modules whose ``__all__`` is the package's public API
_PUBLIC_MODULES: tuple[str, ...] = (
    "impl.adapter.gather",
    "impl.bridge.bridge",
    "impl.compat",
    "impl.conversion.coverage",
    "impl.bridge.dispatch",
    "impl.conversion.landing",
    "impl.conversion.dequant",
    "impl.conversion.detect",
    "impl.adapter.consumers",
    "impl.adapter.dialects",
    "impl.conversion.base_dir",
    "impl.errors",
    "impl.adapter.build",
    "impl.adapter.export",
    "impl.adapter.files",
    "impl.adapter.phases",
    "impl.adapter.validation",
    "impl.adapter.fingerprint",
    "impl.conversion.hardware",
    "impl.lora.wrappers",
    "impl.lora.optimizer",
    "impl.adapter.training_checkpoint",
    "impl.adapter.resume",
    "impl.adapter.importer",
    "impl.conversion.mapping",
    "impl.native.config",
    "impl.native.hyper",
    "impl.native.layer",
    "impl.native.model",
    "impl.native.moe",
    "impl.native.mtp",
    "impl.native.attention",
    "impl.native.activations",
    "impl.native.parallel",
    "impl.native.placement",
    "impl.native.norm",
    "impl.native.rope",
    "impl.lora.training",
    "impl.lora.peft_loader",
    "impl.conversion.pipeline",
    "impl.native.provider",
    "impl.recipe.flash_lora",
    "impl.recipe.memory",
    "impl.native.schedule",
    "impl.lora.targets",
    "impl.vocabulary",
    "impl.adapter.versions",
    "impl.adapter.publication",
    "impl.cli.main",
    "impl.cli.tested",
    "impl.cli.verify",
)
_EXTRA = ("__version__", "compat_report", "errors")
_ALL_ASSIGNMENT = re.compile(r"^__all__ = (\[[^\]]*\])", re.M)


def _module_all(module: str) -> tuple[str, ...]:
    """A module's ``__all__``, read from its source (a literal list at the module's top level).

    Reading without importing makes a module's ``__all__`` the one place its public names are written, and keeps
    ``import impl`` cheap: ``dsv4-lora verify-adapter`` and exporter ranks never pay for megatron.
    ``suites/meta/test_contract.py`` checks the reading against the imported modules, and
    ``suites/meta/test_compat_first.py`` checks that ``impl.compat.active`` is imported before megatron.
    """
    root = Path(__file__).resolve().parent.joinpath(*module.split(".")[1:])
    path = root / "__init__.py" if root.is_dir() else root.with_suffix(".py")
    found = _ALL_ASSIGNMENT.search(path.read_text())
    if found is None:
        raise ImportError(f"{path}: no literal __all__ = [...]; the package's public API is read from it")
    return tuple(ast.literal_eval(found.group(1)))


@cache
def _where() -> dict[str, str]:
    """Public name -> the module that provides it."""
    return {name: module for module in _PUBLIC_MODULES for name in _module_all(module)}


def compat_report():
    """Which CPU compatibility pieces are active in this process (installs them on first call)."""
    from impl.compat import install

    return install()


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted([*_where(), *_EXTRA])
    module = _where().get(name)
    if module is None:
        if name == "errors":
            return importlib.import_module("impl.errors")
        raise AttributeError(f"module 'impl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*_where(), *_EXTRA])
