"""Typed errors of ``tiny_models``.

``tiny_models`` must not import ``impl`` (it serves any implementation), so these do not subclass
``impl.errors.Dsv4Error``; they subclass :class:`TinyModelsError` plus the matching builtin.
"""

from __future__ import annotations

__all__ = [
    "TinyModelsError",
    "UnknownPresetError",
    "CheckpointNameError",
    "CheckpointLoadError",
    "ManifestError",
]


class TinyModelsError(Exception):
    """Base class of every error raised by ``tiny_models``."""


class UnknownPresetError(TinyModelsError, KeyError):
    """A preset name that is not in ``tiny_models.presets.PRESETS``."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CheckpointNameError(TinyModelsError, ValueError):
    """A tensor name that the official <-> transformers name table does not know."""


class CheckpointLoadError(TinyModelsError, RuntimeError):
    """transformers reported missing / unexpected / mismatched keys when loading a written checkpoint."""


class ManifestError(TinyModelsError, ValueError):
    """A config whose tensor manifest cannot be built (e.g. MXFP4 packing needs ``in % 32 == 0``)."""
