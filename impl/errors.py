"""Typed errors. Every error this package raises on bad input subclasses :class:`Dsv4Error`,
names the offending object, and says what to do next."""

from __future__ import annotations

__all__ = [
    "Dsv4Error",
    "NotDeepseekV4Error",
    "DeepseekV41UnsupportedError",
    "UnsupportedConfigError",
    "MultiLoRAUnsupportedError",
    "CorruptCheckpointError",
    "CheckpointMappingError",
    "QuantizationError",
    "TargetError",
    "GroupedLoRAError",
    "ExportError",
    "PipelineLayoutError",
    "InputFileError",
    "ConfigFileError",
    "ShardIndexError",
    "OutputPathError",
    "UsageError",
    "ConsumerSupportError",
    "PickleAdapterError",
]


class Dsv4Error(Exception):
    """Base class of every typed error raised by ``impl``."""


class NotDeepseekV4Error(Dsv4Error, ValueError):
    """A config was routed to the V4 path but is not exactly ``DeepseekV4ForCausalLM``."""


class DeepseekV41UnsupportedError(NotDeepseekV4Error):
    """The config is DeepSeek-V4.1: another architecture under similar names, not supported yet."""


class UnsupportedConfigError(Dsv4Error, ValueError):
    """A V4 config or parallel layout this implementation cannot build (named in the message)."""


class MultiLoRAUnsupportedError(Dsv4Error, NotImplementedError):
    """Multi-LoRA on the native DeepSeek-V4 graph is not supported."""


class CheckpointMappingError(Dsv4Error, KeyError):
    """Strict load/export found unmapped, missing, duplicated or mis-shaped tensors (all listed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CorruptCheckpointError(Dsv4Error, ValueError):
    """A checkpoint file cannot be read as safetensors (file named)."""


class QuantizationError(Dsv4Error, ValueError):
    """A quantized tensor or its ``.scale`` companion is malformed (tensor named)."""


class TargetError(Dsv4Error, ValueError):
    """A LoRA target or exclusion matches no module, or is ambiguous."""


class GroupedLoRAError(Dsv4Error, RuntimeError):
    """A grouped ``wo_a`` weight, input or adapter output has the wrong group layout."""


class ExportError(Dsv4Error, RuntimeError):
    """Adapter export failed (on one or more ranks); nothing was published."""


class PipelineLayoutError(Dsv4Error, ValueError):
    """A pipeline layout is impossible for this model (named stage and reason)."""


class InputFileError(Dsv4Error, ValueError):
    """An input file or directory is missing, unreadable, or not what it must be (path named)."""


class ConfigFileError(InputFileError):
    """A JSON config (``config.json``, ``adapter_config.json``, a shard index, a manifest, a recipe) is not valid
    JSON, not an object, or lacks a required key (file and key named)."""


class ShardIndexError(CorruptCheckpointError):
    """``model.safetensors.index.json`` and the shard files disagree: a named shard is missing, a shard is not
    named, or a tensor sits in another shard than the index says."""


class OutputPathError(Dsv4Error, ValueError):
    """An output path cannot be created or written (path and reason named)."""


class UsageError(Dsv4Error, ValueError):
    """Command-line arguments that cannot work (the command exits 2, like a parse error)."""


class ConsumerSupportError(ExportError):
    """A serving engine (consumer, version) would not apply, would skip or would misroute a target of the adapter
    (each named with the engine's reason), or impl holds no rules for that consumer or version."""


class PickleAdapterError(InputFileError):
    """A pickled adapter (``adapter_model.bin`` / ``*.pt``) cannot be converted: missing, refused by
    ``torch.load(weights_only=True)``, or not a flat dict of tensors (file and what it holds named)."""
