"""Reading an official-layout V4 checkpoint without loading it: safetensors headers (shape, dtype, file; parsed by
:mod:`impl.conversion.headers`), a lazy tensor view, and the header-only checks of quantized weights and their
``.scale`` companions.

Everything here reads headers only, so the strict load (:mod:`impl.bridge.bridge`) can judge a full-size
checkpoint, agree across ranks and fail before any collective or any tensor read."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from impl.conversion.headers import Header, read_headers

try:  # Megatron-Bridge >= 0.5.0 dequantizes FP8 / MXFP4 checkpoint weights; 0.4.x has no such module.
    from megatron.bridge.models.conversion.quantization_utils import maybe_dequantize_hf_quantized_weight
except ModuleNotFoundError:
    maybe_dequantize_hf_quantized_weight = None

__all__ = [
    "QUANTIZED_DTYPES",
    "QUANT_PREFIXES",
    "Header",
    "LazyState",
    "effective_shape",
    "maybe_dequantize_hf_quantized_weight",
    "quantization_problems",
    "read_headers",
]


class LazyState(Mapping[str, torch.Tensor]):
    """Read-on-demand view of the checkpoint tensors (what the dequantizer indexes into)."""

    def __init__(self, ckpt_dir: Path, headers: dict[str, Header]):
        self._dir = ckpt_dir
        self._headers = headers
        self._handles: dict[str, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        h = self._headers[name]
        if h.file not in self._handles:
            self._handles[h.file] = safe_open(str(self._dir / h.file), framework="pt")
        return self._handles[h.file].get_tensor(h.stored or name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers)

    def __len__(self) -> int:
        return len(self._headers)


def effective_shape(name: str, headers: dict[str, Header]) -> tuple[int, ...]:
    """Logical shape of an official weight; MXFP4 (int8 + ``.scale``) packs two values per byte."""
    h = headers[name]
    if h.dtype == "I8" and len(h.shape) == 2:  # a missing scale is reported by quantization_problems
        return (h.shape[0], h.shape[1] * 2)
    return h.shape


# UE8M0 (instruct) or F32 (*-Base) block scales: docs/reference/v4_architecture.md §3.3
_SCALE_DTYPES = ("F8_E8M0", "F32")
_PLAIN_DTYPES = ("F32", "BF16", "F16", "I64", "I32")
QUANTIZED_DTYPES = ("F8_E4M3", "I8")  # FP8 E4M3, MXFP4 (two e2m1 codes per int8 byte)
_FP8_BLOCK, _MXFP4_BLOCK = 128, 32
QUANT_PREFIXES = ("unscaled ", "bad scale ", "bad quantized weight ", "undequantizable ")


def quantization_problems(name: str, headers: dict[str, Header]) -> list[str]:
    problems = _scale_problems(name, headers)
    if maybe_dequantize_hf_quantized_weight is None and headers[name].dtype in QUANTIZED_DTYPES:
        problems.append(
            f"undequantizable {name}: {headers[name].dtype} weight, but this megatron-bridge has no "
            "models.conversion.quantization_utils dequantizer (added in 0.5.0); use megatron-bridge>=0.5 "
            "or store the checkpoint unquantized"
        )
    return problems


def _scale_problems(name: str, headers: dict[str, Header]) -> list[str]:
    """Header-only checks of one consumed weight and its ``.scale`` companion (Megatron-Bridge's dequantizer
    silently casts an FP8 weight without a scale, and ignores a scale next to an unquantized weight)."""
    h = headers[name]
    scale = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
    sh = headers.get(scale) if scale else None
    fix = (
        "re-quantize it (FP8 E4M3 + 128x128 scales, or MXFP4 int8 + [out, in/32] UE8M0 scales) or store it unquantized"
    )
    if h.dtype in QUANTIZED_DTYPES:
        if sh is None:
            return [f"unscaled {name}: {h.dtype} weight {h.shape} has no {scale} companion; {fix}"]
        if len(h.shape) != 2:
            return [f"bad quantized weight {name}: {h.dtype} needs 2 dims, got {h.shape}; {fix}"]
        out_dim, in_dim = h.shape
        if h.dtype == "F8_E4M3":
            want = (-(-out_dim // _FP8_BLOCK), -(-in_dim // _FP8_BLOCK))
        else:  # MXFP4: two e2m1 values per byte, one scale per 32 inputs
            in_dim *= 2
            if in_dim % _MXFP4_BLOCK:
                return [f"bad quantized weight {name}: MXFP4 input dim {in_dim} is not a multiple of 32; {fix}"]
            want = (out_dim, in_dim // _MXFP4_BLOCK)
        problems = []
        if sh.dtype not in _SCALE_DTYPES:
            problems.append(f"bad scale {scale}: dtype {sh.dtype}, expected one of {_SCALE_DTYPES}; {fix}")
        if sh.shape != want:
            problems.append(f"bad scale {scale}: shape {sh.shape}, expected {want} for {h.dtype} {name} {h.shape}")
        return problems
    if h.dtype not in _PLAIN_DTYPES:
        return [f"bad quantized weight {name}: dtype {h.dtype} is not supported; {fix}"]
    if sh is not None:
        return [f"bad scale {scale}: companion of unquantized {h.dtype} weight {name} (it would be ignored)"]
    return []
