"""CPU replacements for the CUDA-only calls megatron-core makes unconditionally.

megatron-core hard-codes ``torch.cuda.current_device()`` (rotary cache, global memory buffer) and the CUDA RNG tracker
(``model_parallel_cuda_manual_seed``, attention dropout); Megatron's DDP wrapping creates a CUDA stream. Without CUDA
these raise; the replacements route them to the CPU generator. They are installed only when
``torch.cuda.is_available()`` is False, so a GPU node runs megatron-core untouched."""

from __future__ import annotations

import contextlib

import torch

_INSTALLED = False


def install_if_no_cuda(cuda_available: bool | None = None) -> bool:
    """Install the CPU shims when CUDA is unavailable. Returns True when they are (now) active.

    The calls replaced are those of megatron-core 0.19.2 and of Megatron's DDP wrapping
    (``megatron.training.models.dist_utils._ddp_wrap``, which creates a CUDA stream)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return False
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # torch.manual_seed calls manual_seed_all; it must not recurse into the CPU generator.
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # DDP construction runs inside a side stream; on the CPU there is only one "stream".
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _INSTALLED = True
    return True


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def is_installed() -> bool:
    return _INSTALLED
