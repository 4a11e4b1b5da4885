"""Tiny DeepSeek-V4 models for the conformance suite: presets, an official-layout checkpoint writer,
the transformers oracle loader, tensor manifests (tiny to Pro) and a hypothesis config strategy
(``tiny_models.config_strategy``). Imports only torch, transformers, safetensors (and hypothesis for strategies),
never ``impl`` or megatron, so any implementation can use it."""

from tiny_models.errors import (
    CheckpointLoadError,
    CheckpointNameError,
    ManifestError,
    TinyModelsError,
    UnknownPresetError,
)
from tiny_models.manifest import TensorSpec, dtype_counts, manifest, manifest_of_checkpoint
from tiny_models.oracle import (
    build_random_model,
    load_oracle,
    official_state_dict,
    official_to_transformers_name,
    transformers_to_official_name,
    write_checkpoint,
)
from tiny_models.presets import PRESETS, flash_config, get_preset, min_seq_len, pro_config

__all__ = [
    "PRESETS",
    "CheckpointLoadError",
    "CheckpointNameError",
    "ManifestError",
    "TensorSpec",
    "TinyModelsError",
    "UnknownPresetError",
    "build_random_model",
    "dtype_counts",
    "flash_config",
    "get_preset",
    "load_oracle",
    "manifest",
    "manifest_of_checkpoint",
    "min_seq_len",
    "official_state_dict",
    "official_to_transformers_name",
    "pro_config",
    "transformers_to_official_name",
    "write_checkpoint",
]
