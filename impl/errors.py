"""Typed errors, all of them: every error class of the package is defined here (``suites/meta/test_errors_in_one_place.py``
checks it) and re-exported by the module that raises it. Every error this package raises on bad input subclasses
:class:`Dsv4Error`, names the offending object, and says what to do next."""

from __future__ import annotations

__all__ = [
    "AdapterGatherError",
    "AdapterImportError",
    "AdapterShapeError",
    "AdapterValidationError",
    "AttentionInputError",
    "BridgeImportError",
    "CheckpointMappingError",
    "CollectiveExportError",
    "ConfigFileError",
    "ConsumerSupportError",
    "CorruptCheckpointError",
    "DeepseekV41UnsupportedError",
    "DevicePlacementError",
    "Dsv4Error",
    "EmptyAdapterError",
    "ExportError",
    "FingerprintMismatchError",
    "GroupedLoRAError",
    "InputFileError",
    "MappingTableError",
    "MissingAdapterHalfError",
    "MtpNotExportableError",
    "MultiLoRAUnsupportedError",
    "NativeShardError",
    "NonFiniteAdapterError",
    "NotDeepseekV4Error",
    "OutputPathError",
    "PipelineLayoutError",
    "ProviderDispatchError",
    "PublicationError",
    "PublishedVersionError",
    "QuantizationError",
    "ShardIndexError",
    "TargetError",
    "TrainingCheckpointError",
    "TransformerEngineImportError",
    "TransformerEngineStubError",
    "UnsupportedConfigError",
    "UpstreamAdapterError",
    "UsageError",
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


class DevicePlacementError(Dsv4Error, RuntimeError):
    """Tensors of a rank live on another device than the rank's (every one is named)."""


class AttentionInputError(Dsv4Error, ValueError):
    """The attention got hidden states / position ids of the wrong shape or dtype (named in the message)."""


class AdapterGatherError(ExportError):
    """The shards of one adapter tensor do not fit together (ranks or stages disagree); names the tensor."""


class AdapterValidationError(ExportError):
    """An exported adapter directory is inconsistent (file, tensor or field named)."""


class UpstreamAdapterError(ExportError):
    """An upstream-layout adapter name that no Megatron-Bridge LoRA can produce (named, with the reason)."""


class EmptyAdapterError(ExportError):
    """The adapter state holds no tensors, or a declared target has none."""


class MissingAdapterHalfError(ExportError):
    """A module has lora_A without lora_B (or the reverse)."""


class AdapterShapeError(ExportError):
    """A LoRA tensor's shape disagrees with r or with the base weight it adapts."""


class NonFiniteAdapterError(ExportError):
    """A LoRA tensor holds NaN or Inf."""


class MtpNotExportableError(ExportError):
    """MTP adapters cannot be expressed in the requested dialect."""


class PublicationError(ExportError):
    """A collective publication failed on one or more ranks (named, with the cause); nothing was published."""


class PublishedVersionError(ExportError):
    """A versioned publication root without a current version, or a pointer that leads nowhere."""


class AdapterImportError(InputFileError):
    """A published adapter that cannot be loaded into this model; names the file, tensor or setting."""


class CollectiveExportError(ExportError):
    """The export failed on one or more ranks; the message names each rank, its phase and cause."""


class NativeShardError(ExportError):
    """Native LoRA shards that do not make one adapter (missing ranks, replicas that disagree, odd names)."""


class FingerprintMismatchError(Dsv4Error, ValueError):
    """The adapter was trained against a different base (the differing tensors are named)."""


class TransformerEngineStubError(RuntimeError):
    """A CPU import stub of transformer_engine was used as if it were the real package."""


class TransformerEngineImportError(Dsv4Error, ImportError):
    """``transformer_engine`` is installed but fails to import (the cause is chained and named)."""


class BridgeImportError(Dsv4Error, ImportError):
    """Megatron-Bridge is installed but cannot import against this transformers (a module it imports is gone)."""


class TrainingCheckpointError(Dsv4Error, RuntimeError):
    """A training checkpoint could not be written, or is not one to resume from; names the file and the cause."""


class MappingTableError(Dsv4Error, ValueError):
    """The table itself is malformed (duplicate / ambiguous pattern, bad semantics or group)."""


class ProviderDispatchError(Dsv4Error, LookupError):
    """Megatron-Bridge's provider dispatch sends DeepSeek-V4 to another bridge on this pin (named, with why)."""
