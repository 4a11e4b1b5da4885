"""Import-only stand-in for ``transformer_engine`` on hosts where it cannot be installed.

Megatron-Bridge imports ``transformer_engine.pytorch`` unconditionally (``peft/lora_layers.py``)
and uses ``te.ops.Sequential`` in class annotations, so attribute access must work at import time.
Instantiating or calling anything raises :class:`TransformerEngineStubError`, so no code path can
silently run on a fake. The stub is never installed when the real package imports."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from impl.errors import TransformerEngineStubError

STUB_VERSION = "0.0.0"


def _placeholder_attribute(owner: object, qualname: str, attr: str) -> type:
    """A missing attribute of a stub module or class: a placeholder class, remembered on ``owner``; dunders stay
    missing (``hasattr(x, "__wrapped__")`` and friends must answer False)."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    value = _placeholder(f"{qualname}.{attr}")
    setattr(owner, attr, value)
    return value


class _PlaceholderMeta(type):
    def __getattr__(cls, attr: str):
        return _placeholder_attribute(cls, f"{cls.__module__}.{cls.__qualname__}", attr)

    def __call__(cls, *args, **kwargs):
        raise TransformerEngineStubError(
            f"{cls.__module__}.{cls.__qualname__} was used, but transformer_engine is only an import stub on "
            "this CPU host; use a local (non-TE) layer spec, or run on a GPU node with Transformer Engine installed"
        )


def _placeholder(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return _PlaceholderMeta(name, (object,), {"__module__": module, "__qualname__": name})


class _StubModule(types.ModuleType):
    __te_stub__ = True

    def __getattr__(self, attr: str):
        return _placeholder_attribute(self, self.__name__, attr)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = STUB_VERSION
        return module

    def exec_module(self, module):
        pass


def real_te_available() -> bool:
    """True when a real transformer_engine can be found (the stub itself does not count)."""
    if is_installed():
        return False
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def is_installed() -> bool:
    return any(isinstance(f, _StubFinder) for f in sys.meta_path)


def install_if_absent() -> bool:
    """Install the stub unless real TE exists. Returns True when the stub is (now) active."""
    if is_installed():
        return True
    if real_te_available():
        return False
    sys.meta_path.insert(0, _StubFinder())
    return True
