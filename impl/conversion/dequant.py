"""Dequantization of the official checkpoint's FP8 and MXFP4 weights, bit-identical to Megatron-Bridge's, faster.

Megatron-Bridge (``quantization_utils.maybe_dequantize_hf_quantized_weight``) unpacks MXFP4 through two int64 index
tensors, a stack and a full-size ``repeat_interleave`` of the scales, and FP8 through full-size fp32 scale maps:
on one Flash layer that is most of the load time. Here the same values come from one 256-entry byte -> (low, high)
table lookup and block-broadcast scales. Exactness: an e2m1 value (2 significant bits) or an FP8 E4M3 value
(4 bits) times a power of two (UE8M0 scale) is representable in bf16 / fp32 unless it leaves the exponent range,
so computing in the target dtype rounds the exact product once, as Bridge's fp32-then-cast does. Scales that are
not powers of two (fp32, the *-Base checkpoints) are applied in fp32 and cast once, as Bridge does.
Layouts the validation accepts (``[ceil(o/128), ceil(i/128)]`` FP8 block scales, ``[o, i/32]`` MXFP4 scales)
take the fast path; anything else is handed to Megatron-Bridge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache

import torch
import torch.nn.functional as F

__all__ = ["E2M1_VALUES", "dequantize_fp8_blocks", "dequantize_mxfp4", "dequantize_official", "read_official"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_BLOCK = 128
MXFP4_BLOCK = 32
_EXACT_SCALES = (torch.float8_e8m0fnu,)  # powers of two


@cache
def _code_table(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[2**bits, bits // 4]``: the e2m1 values packed in a ``bits``-wide little-endian word, lowest nibble first
    (= the even column of each byte first), in ``dtype``. (A 16-bit word table measured no faster on the CPU.)"""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    word = torch.arange(2**bits)
    nibbles = [(word >> (4 * j)) & 0xF for j in range(bits // 4)]
    return torch.stack([values[n] for n in nibbles], dim=-1).to(dtype=dtype, device=device)


def _compute_dtype(scale: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if scale.dtype in _EXACT_SCALES and dtype.is_floating_point else torch.float32


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """int8 ``[o, i/2]`` (two e2m1 codes per byte) x ``[o, i/32]`` scales -> ``[o, i]`` in ``dtype``."""
    rows, half = packed.shape
    work = _compute_dtype(scale, dtype)
    values = F.embedding(packed.view(torch.uint8).to(torch.int32), _code_table(8, work, packed.device))
    values = values.view(rows, scale.shape[1], (2 * half) // scale.shape[1])
    values.mul_(scale.to(work).unsqueeze(-1))
    return values.view(rows, 2 * half).to(dtype)


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """FP8 E4M3 ``[o, i]`` x ``[ceil(o/128), ceil(i/128)]`` block scales -> ``[o, i]`` in ``dtype``."""
    rows, cols = weight.shape
    work = _compute_dtype(scale, dtype)
    out = weight.to(work)
    s = scale.to(work)
    full_r, full_c = rows // FP8_BLOCK * FP8_BLOCK, cols // FP8_BLOCK * FP8_BLOCK
    if full_r and full_c:  # the whole blocks, broadcast without materializing a full-size scale map
        body = out[:full_r, :full_c].unflatten(0, (-1, FP8_BLOCK)).unflatten(2, (-1, FP8_BLOCK))
        body.mul_(s[: full_r // FP8_BLOCK, : full_c // FP8_BLOCK, None][:, None, :, :])
    if full_r < rows:  # the partial last row of blocks
        out[full_r:].mul_(s[-1].repeat_interleave(FP8_BLOCK)[:cols])
    if full_c < cols:  # the partial last column of blocks (rows above full_r)
        out[:full_r, full_c:].mul_(s[: full_r // FP8_BLOCK, -1].repeat_interleave(FP8_BLOCK).unsqueeze(-1))
    return out.to(dtype)


def _fast_path(weight: torch.Tensor, scale: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    if weight.dim() != 2 or scale.dim() != 2:
        return None
    rows, cols = weight.shape
    if weight.dtype == torch.int8 and scale.shape[0] == rows and (2 * cols) % scale.shape[1] == 0:
        return dequantize_mxfp4
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == blocks:
        return dequantize_fp8_blocks
    return None


def dequantize_official(
    hf_param: str | dict[str, str],
    state: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    fallback: Callable[..., object],
    device: torch.device | None = None,
) -> object:
    """What ``maybe_dequantize_hf_quantized_weight(hf_param, state, dtype=dtype)`` returns (``fallback`` is that
    function): a tensor per name, dequantized when it has a ``.scale`` companion. With ``device`` (the destination
    parameter's) the quantized bytes move there first and are dequantized there: on a GPU that moves a quarter
    (MXFP4) or half (FP8) of the bf16 bytes over the bus and runs the lookups on the device."""
    if isinstance(hf_param, dict):
        return {
            k: dequantize_official(v, state, dtype=dtype, fallback=fallback, device=device) for k, v in hf_param.items()
        }
    weight = state[hf_param]
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn) or not hf_param.endswith(".weight"):
        return fallback(hf_param, state, dtype=dtype)
    scale_name = hf_param[: -len(".weight")] + ".scale"
    scale = state[scale_name] if scale_name in state else None
    fast = None if scale is None else _fast_path(weight, scale)
    if fast is None:
        return fallback(hf_param, state, dtype=dtype)
    if device is not None:
        weight, scale = weight.to(device), scale.to(device)
    return fast(weight, scale, dtype=dtype)


def read_official(
    hf_param: str | dict[str, str],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    dequantizer: Callable[..., object] | None,
) -> object:
    """The checkpoint tensor(s) a mapping reads, dequantized like Megatron-Bridge's ``dequantizer`` (None on pins
    without one: validation has then rejected every quantized weight, so these are plain tensors)."""
    if dequantizer is not None:
        return dequantize_official(hf_param, state, dtype=dtype, fallback=dequantizer, device=device)
    return {k: state[v] for k, v in hf_param.items()} if isinstance(hf_param, dict) else state[hf_param]
