"""The native DeepSeek-V4 graph on Megatron-Core: config, attention stack, hyper-connections, MoE, layers, model.

Importing this package installs the CPU compat layer first (``impl.compat.active``), as every module that imports
megatron does.
"""

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split
from impl.native.config import V4Config
from impl.native.hyper import HyperHead, hc_head, hc_post, hc_pre
from impl.native.layer import DeepseekV4DecoderLayer
from impl.native.model import DeepseekV4NativeModel, validate_parallel_layout
from impl.native.moe import V4Expert, V4Experts, V4MoE, V4Router, expert_parallel_layout
from impl.native.mtp import DeepseekV4MTPBlock, DeepseekV4MTPLayer

__all__ = [
    "DeepseekV4DecoderLayer",
    "DeepseekV4MTPBlock",
    "DeepseekV4MTPLayer",
    "DeepseekV4NativeModel",
    "HyperHead",
    "V4Config",
    "V4Expert",
    "V4Experts",
    "V4MoE",
    "V4Router",
    "expert_parallel_layout",
    "hc_head",
    "hc_post",
    "hc_pre",
    "validate_parallel_layout",
]
