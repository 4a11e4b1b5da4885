"""Reference implementation: LoRA on DeepSeek-V4 with Megatron-Core and Megatron-Bridge.

Public API (what the suites reach through the ``impl`` fixture) is listed in ``__all__``.
Importing this package makes the Megatron stack usable on this host (``impl.compat``).
"""

from impl.compat import CompatReport, TransformerEngineStubError
from impl.compat import install as _install_compat

_COMPAT = _install_compat()

from impl import errors  # noqa: E402
from impl.detect import V4_ARCHITECTURE, is_deepseek_v4_config, require_deepseek_v4_config  # noqa: E402
from impl.errors import *  # noqa: E402,F403
from impl.hardware import (  # noqa: E402
    FusedKernelDefaults,
    deepseek_v4_supports_blackwell_fused_kernels,
    deepseek_v4_supports_fused_dsa_kernels,
    fused_kernel_defaults,
)
from impl.pipeline import (  # noqa: E402
    generate_pipeline_layout,
    resolve_pipeline_layout,
    stage_layer_numbers,
    validate_pipeline_layout,
)

__version__ = "0.1.0"


def compat_report() -> CompatReport:
    """Which CPU compatibility pieces are active in this process."""
    return _COMPAT


__all__ = [
    "__version__",
    "CompatReport",
    "FusedKernelDefaults",
    "TransformerEngineStubError",
    "V4_ARCHITECTURE",
    "compat_report",
    "deepseek_v4_supports_blackwell_fused_kernels",
    "deepseek_v4_supports_fused_dsa_kernels",
    "errors",
    "fused_kernel_defaults",
    "generate_pipeline_layout",
    "resolve_pipeline_layout",
    "stage_layer_numbers",
    "validate_pipeline_layout",
    "is_deepseek_v4_config",
    "require_deepseek_v4_config",
    *errors.__all__,
]
