"""Hardware gates for DeepSeek-V4 fused-kernel defaults (Megatron-Bridge #4338 / #4445 behaviour, described in
``docs/reference/megatron_bridge.md``). Fused mHC and fused DSA kernels exist only for Blackwell, CUDA capability
major >= 10. Without CUDA the answer must be False, or CPU and H100 runs pick kernels they cannot execute. A Blackwell
host without the DSA kernels' packages must not default to kernels it cannot import (#4445 checks the same imports)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FusedKernelDefaults",
    "deepseek_v4_supports_blackwell_fused_kernels",
    "deepseek_v4_supports_fused_dsa_kernels",
    "fused_kernel_defaults",
]

BLACKWELL_MAJOR = 10


def _capability_major() -> int | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0]


def deepseek_v4_supports_blackwell_fused_kernels() -> bool:
    """True only with CUDA capability major >= 10; False without CUDA.

    Megatron-Bridge 0.5.0 returned True without CUDA, which made CPU and H100 runs pick kernels they cannot execute.
    """
    major = _capability_major()
    return major is not None and major >= BLACKWELL_MAJOR


#: (module, attribute) the fused DSA path imports.
DSA_KERNEL_IMPORTS: tuple[tuple[str, str], ...] = (("cudnn", "DSA"), ("flash_mla", "flash_mla_sparse_fwd"))


def _dsa_kernels_importable() -> bool:
    for module, name in DSA_KERNEL_IMPORTS:
        try:
            if not hasattr(__import__(module, fromlist=[name]), name):
                return False
        except ImportError:
            return False
    return True


def deepseek_v4_supports_fused_dsa_kernels() -> bool:
    """The DSA (indexer/sparse attention) fused kernels: the Blackwell gate, and their packages importable.

    The packages are cuDNN's ``DSA`` and FlashMLA's sparse forward (:data:`DSA_KERNEL_IMPORTS`)."""
    return deepseek_v4_supports_blackwell_fused_kernels() and _dsa_kernels_importable()


@dataclass(frozen=True)
class FusedKernelDefaults:
    use_fused_mhc: bool
    apply_dsa_kernel_fusion: bool


def fused_kernel_defaults() -> FusedKernelDefaults:
    """Defaults a V4 recipe should use on this host."""
    return FusedKernelDefaults(
        use_fused_mhc=deepseek_v4_supports_blackwell_fused_kernels(),
        apply_dsa_kernel_fusion=deepseek_v4_supports_fused_dsa_kernels(),
    )
