"""Reference implementation: LoRA on DeepSeek-V4 with Megatron-Core and Megatron-Bridge.

The public API (what the suites reach through the ``impl`` fixture) is ``__all__``. Names load lazily:
``import impl`` is cheap, and every module that imports megatron imports ``impl.compat.active`` first, which
installs the CPU compatibility layer (``suites/meta/test_compat_first.py`` checks it). So ``dsv4-lora
verify-adapter`` and exporter ranks never pay for megatron, and nothing can import megatron ahead of the layer.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: module -> public names it provides
_PUBLIC: dict[str, tuple[str, ...]] = {
    "impl.adapter.gather": ("gather_adapter_state",),
    "impl.conversion.bridge": (
        "DeepseekV4ConversionBridge",
        "LoadReport",
        "export_merged_state",
        "export_official_state",
        "load_official_checkpoint",
    ),
    "impl.compat": ("CompatReport",),
    "impl.conversion.coverage": (
        "CoverageReport",
        "coverage_report",
    ),
    "impl.conversion.dispatch": ("provider_through_megatron_bridge",),
    "impl.conversion.landing": ("landing_views",),
    "impl.conversion.dequant": (
        "dequantize_fp8_blocks",
        "dequantize_mxfp4",
    ),
    "impl.conversion.detect": (
        "V4_ARCHITECTURE",
        "is_deepseek_v41_config",
        "is_deepseek_v4_config",
        "require_deepseek_v4_config",
    ),
    "impl.adapter.consumers": (
        "CONSUMER_RULES",
        "ConsumerRule",
        "ConsumerStatus",
        "consumer_rule",
        "consumer_verdict",
        "unapplied_targets",
    ),
    "impl.adapter.dialects": (
        "DIALECTS",
        "match_native",
        "parse_native",
        "resolve_module",
        "translate_module",
    ),
    "impl.conversion.base_dir": (
        "inspect_base",
        "read_base_dir",
    ),
    "impl.errors": (
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
    ),
    "impl.adapter.build": (
        "AdapterState",
        "publish_in_memory",
    ),
    "impl.adapter.export": ("export_adapter",),
    "impl.adapter.files": (
        "COMPLETE_MARKER",
        "recover_export_dir",
    ),
    "impl.adapter.phases": ("EXPORT_PHASES",),
    "impl.adapter.validation": ("validate_adapter_dir",),
    "impl.adapter.fingerprint": (
        "base_fingerprint",
        "read_adapter_fingerprint",
        "verify_fingerprint",
    ),
    "impl.conversion.hardware": (
        "FusedKernelDefaults",
        "deepseek_v4_supports_blackwell_fused_kernels",
        "deepseek_v4_supports_fused_dsa_kernels",
        "fused_kernel_defaults",
    ),
    "impl.lora.wrappers": (
        "DeepseekV4LoRA",
        "LoraHandle",
        "MTP_POLICIES",
        "MtpPolicy",
        "apply_grouped_wo_a",
        "apply_lora",
        "make_lora_pre_wrap_hook",
    ),
    "impl.lora.optimizer": ("AdapterOptimizer",),
    "impl.lora.checkpoint": (
        "CHECKPOINT_FORMAT",
        "save_training_checkpoint",
    ),
    "impl.lora.resume": (
        "ResumeInfo",
        "latest_training_checkpoint",
        "read_training_checkpoint",
        "resume_training",
    ),
    "impl.adapter.importer": (
        "import_adapter",
        "read_published_adapter",
    ),
    "impl.conversion.mapping": (
        "MAPPING_TABLE",
        "MappingRow",
        "check_mapping_table",
        "NATIVE_LAYOUTS",
        "lookup_native",
        "lookup_official",
        "lookup_official_upstream",
        "lookup_upstream",
    ),
    "impl.native.config": ("V4Config",),
    "impl.native.hyper": (
        "HyperHead",
        "hc_head",
        "hc_post",
        "hc_pre",
    ),
    "impl.native.layer": ("DeepseekV4DecoderLayer",),
    "impl.native.model": (
        "DeepseekV4NativeModel",
        "validate_parallel_layout",
    ),
    "impl.native.moe": (
        "V4Expert",
        "V4Experts",
        "V4MoE",
        "V4Router",
        "expert_parallel_layout",
    ),
    "impl.native.mtp": (
        "DeepseekV4MTPBlock",
        "DeepseekV4MTPLayer",
    ),
    "impl.native.attention": (
        "DeepseekV4Attention",
        "grouped_wo_a",
    ),
    "impl.native.activations": ("ActivationPlan",),
    "impl.native.parallel": ("cpu_initialization",),
    "impl.native.placement": (
        "Misplaced",
        "audit_devices",
        "rank_device",
        "require_devices",
    ),
    "impl.native.norm": (
        "RMSNorm",
        "ReplicatedLinear",
    ),
    "impl.native.rope": (
        "ROPE_FUSION_FALLBACKS",
        "RopeFusion",
        "RopeFusionFallback",
        "RopeFusionFallbackWarning",
        "apply_interleaved_rope",
        "decide_rope_fusion",
        "rope_inv_freq",
    ),
    "impl.lora.training": ("adapter_train_step",),
    "impl.lora.peft_loader": (
        "GroupedLoraLinear",
        "load_peft_adapter",
    ),
    "impl.conversion.pipeline": (
        "generate_pipeline_layout",
        "resolve_pipeline_layout",
        "run_pipeline_layout",
        "saved_pipeline_layout",
        "stage_layer_numbers",
        "validate_pipeline_layout",
    ),
    "impl.native.provider": (
        "DeepseekV4NativeProvider",
        "build_native_model",
    ),
    "impl.recipe.flash_lora": (
        "CHECKPOINT_ENV",
        "FLASH_SHAPE",
        "PRO_SHAPE",
        "DeepseekV4LoRARecipe",
        "ModelShape",
        "OptimizerSettings",
        "TINY_MODELS",
        "TinyModel",
        "deepseek_v4_flash_lora_recipe",
        "deepseek_v4_pro_lora_recipe",
        "sft_fused_kernel_defaults",
        "tiny_variant",
        "to_qualify_args",
    ),
    "impl.recipe.memory": (
        "ActivationShape",
        "StageMemory",
        "format_memory_table",
        "layer_activation_bytes",
        "recipe_memory",
        "stage_activation_bytes",
    ),
    "impl.cli.qualify": (
        "QualifyOptions",
        "run_qualify",
    ),
    "impl.native.schedule": ("ManualPipeline",),
    "impl.lora.targets": (
        "MAIN_ATTENTION_TARGETS",
        "NESTED_ATTENTION_TARGETS",
        "TARGET_VOCABULARY",
        "qualify_exclusions",
        "qualify_targets",
    ),
    "impl.lora.vocabulary": (
        "ParallelStyle",
        "TARGET_TABLE",
        "TargetRow",
        "TargetTable",
    ),
    "impl.adapter.versions": (
        "POINTER",
        "publish_version",
        "resolve_current",
        "version_dirs",
    ),
    "impl.adapter.publication": (
        "AdapterPublisher",
        "Publication",
        "tensor_checksum",
    ),
    "impl.cli.main": ("build_parser",),
    "impl.cli.tested": (
        "LANES",
        "untested_line",
        "untested_versions",
    ),
    "impl.cli.verify": (
        "VerifyResult",
        "verify_adapter",
    ),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = sorted([*_WHERE, "__version__", "compat_report", "errors"])


def compat_report():
    """Which CPU compatibility pieces are active in this process (installs them on first call)."""
    from impl.compat import install

    return install()


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        if name == "errors":
            return importlib.import_module("impl.errors")
        raise AttributeError(f"module 'impl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
