"""Dequantization of the official checkpoint's FP8 and MXFP4 weights, bit-identical to Megatron-Bridge's, faster.

It must stay bit-identical to Bridge's ``quantization_utils.maybe_dequantize_hf_quantized_weight``: with UE8M0 scales
Bridge's own formula is evaluated once per code and scale byte pair and a weight becomes one gather from that table
(:func:`scaled_table`). Other scales follow Bridge's order of operations; scale layouts the validation does not accept
are handed to Megatron-Bridge (:func:`dequantize_official`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from threading import local

import torch

__all__ = [
    "dequantize_fp8_blocks",
    "dequantize_mxfp4",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_BLOCK = 128
MXFP4_BLOCK = 32
CHUNK = 1 << 20  # table indices built and gathered per step (4 MiB of int32; chunk sizes: docs/performance.md)
PARALLEL_MIN = 1 << 19  # values per worker thread below which the hand-off costs more than it saves
_SCRATCH = local()  # per thread: the table indices of the chunk being gathered
_WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a table entry's bytes -> the integer dtype gathered


def _byte_values(fmt: str) -> torch.Tensor:
    """``[256, k]`` float32: the value(s) one stored byte encodes (MXFP4: low nibble, then high nibble)."""
    byte = torch.arange(256)
    if fmt == "mxfp4":
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1)
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)


@cache
def scaled_table(fmt: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256 * 256]`` words, entry ``code | scale << 8`` = Megatron-Bridge's dequantized value(s) of that code
    byte under that UE8M0 scale byte: ``(float32(value) * float32(scale)).to(dtype)``, packed into one integer of
    the entry's width (``fmt``: ``"fp8"`` one value per byte, ``"mxfp4"`` two).

    Why: Megatron-Bridge computes every value as ``float32(code) * float32(scale)`` cast once to the target dtype,
    through int64 index tensors, a stack, full-size fp32 copies and scale maps: on one Flash layer that is most of
    the load time. With UE8M0 scales (the instruct checkpoints) a value depends on two bytes only, the code byte and
    the scale byte, so Bridge's own formula is evaluated once for all 256 x 256 pairs here and a weight becomes one
    gather from this table, indexed by ``code | scale << 8``, done in row chunks so the index stays in cache. MXFP4
    packs two codes per byte: its entry holds both values (low nibble first), so one gather writes two outputs.
    """
    scales = torch.arange(256).to(torch.uint8).view(torch.float8_e8m0fnu).to(torch.float32)
    table = (scales.view(256, 1, 1) * _byte_values(fmt).unsqueeze(0)).to(dtype).contiguous()
    return table.view(_WORD[table.shape[-1] * table.element_size()]).reshape(-1).to(device)


def _gather(table: torch.Tensor, codes: torch.Tensor, shifted: torch.Tensor, out: torch.Tensor) -> None:
    """``out = table[codes | shifted]`` over ``[rows, a, b]`` views (``shifted``: the scale bytes already shifted
    by 8, int32, broadcastable to ``codes``). On the CPU the rows are split into one contiguous part per torch
    thread of the caller (``torch.get_num_threads()``, so ``OMP_NUM_THREADS`` rules), the first run here, the others
    by worker threads: torch runs a table gather on one core however many it has."""
    rows = codes.shape[0]
    workers = min(torch.get_num_threads(), rows, codes.numel() // PARALLEL_MIN) if codes.device.type == "cpu" else 1
    if workers <= 1:
        _gather_rows(table, codes, shifted, out)
        return
    bounds = [rows * w // workers for w in range(workers + 1)]
    parts = [(codes[lo:hi], shifted[lo:hi], out[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    futures = [_pool(workers - 1).submit(_gather_rows, table, *part) for part in parts[1:]]
    _gather_rows(table, *parts[0])  # this thread takes the first part rather than wait
    for f in futures:
        f.result()


def _gather_rows(table: torch.Tensor, codes: torch.Tensor, shifted: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_gather` on this thread, a chunk of rows at a time so the indices stay in cache."""
    rows = codes.shape[0]
    step = max(1, CHUNK // max(1, codes[0].numel()))
    index = _index_buffer(min(step, rows) * codes[0].numel(), codes.device).view(min(step, rows), *codes.shape[1:])
    for r in range(0, rows, step):
        n = min(step, rows - r)
        index[:n].copy_(codes[r : r + n]).add_(
            shifted[r : r + n]
        )  # one dtype: a mixed-dtype add is slower (docs/performance.md)
        torch.index_select(table, 0, index[:n].view(-1), out=out[r : r + n].view(-1))


def _index_buffer(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 of scratch; on the CPU one buffer per thread, kept (a fresh one per weight is page-faulted anew)."""
    if device.type != "cpu":
        return torch.empty(n, dtype=torch.int32, device=device)  # the caching allocator keeps it
    buf = getattr(_SCRATCH, "index", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.index = torch.empty(max(n, CHUNK), dtype=torch.int32)
    return buf[:n]


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsv4-dequant")


# A forked child has none of the parent's pool threads: a cached pool would queue work no thread ever runs.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _shifted(scale_bytes: torch.Tensor) -> torch.Tensor:
    return scale_bytes.view(torch.uint8).to(torch.int32).bitwise_left_shift_(8)


def _exact(scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """UE8M0 scales and a floating target: the table path (fp32 scales are applied in fp32, as Bridge does)."""
    return scale.dtype == torch.float8_e8m0fnu and dtype.is_floating_point


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int8 ``[o, i/2]`` (two e2m1 codes per byte) x ``[o, i/32]`` scales -> ``[o, i]`` in ``dtype`` (written into
    ``out`` when given: contiguous, that shape and dtype, on the weight's device)."""
    rows, half = packed.shape
    groups = scale.shape[1]
    codes = packed.view(torch.uint8)
    if not _exact(scale, dtype):
        values = _byte_values("mxfp4").to(packed.device)[codes.to(torch.int32)].view(rows, groups, -1)
        values = values.mul_(scale.to(torch.float32).unsqueeze(-1)).view(rows, 2 * half).to(dtype)
        return values if out is None else out.copy_(values)
    out = torch.empty((rows, 2 * half), dtype=dtype, device=packed.device) if out is None else out
    table = scaled_table("mxfp4", dtype, packed.device)
    codes, shifted = codes.view(rows, groups, -1), _shifted(scale).unsqueeze(-1)
    words = out.view(table.dtype).view(rows, groups, -1)  # one word = the two values of one byte
    _gather(table, codes, shifted, words)
    return out


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 E4M3 ``[o, i]`` x ``[ceil(o/128), ceil(i/128)]`` block scales -> ``[o, i]`` in ``dtype`` (into ``out``
    when given, as for :func:`dequantize_mxfp4`)."""
    if not _exact(scale, dtype):
        values = _fp8_in_float32(weight, scale).to(dtype)
        return values if out is None else out.copy_(values)
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=dtype, device=weight.device) if out is None else out
    table = scaled_table("fp8", dtype, weight.device)
    codes, words = weight.view(torch.uint8), out.view(table.dtype)
    col_scales = _shifted(scale).repeat_interleave(FP8_BLOCK, 1)[:, :cols]  # [row blocks, cols]: small
    whole = rows // FP8_BLOCK  # row blocks of 128 rows: codes [blocks, 128, cols], scales [blocks, 1, cols]
    if whole:
        blocked = (whole, FP8_BLOCK, cols)
        _gather(
            table,
            codes[: whole * FP8_BLOCK].view(blocked),
            col_scales[:whole, None],
            words[: whole * FP8_BLOCK].view(blocked),
        )
    if whole * FP8_BLOCK < rows:  # the partial last row block
        tail = slice(whole * FP8_BLOCK, rows)
        _gather(table, codes[tail].unsqueeze(0), col_scales[whole:, None], words[tail].unsqueeze(0))
    return out


def _fp8_in_float32(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Non-power-of-two (fp32) block scales: Bridge's fp32 product, whole blocks broadcast without a full-size
    scale map."""
    rows, cols = weight.shape
    out = weight.to(torch.float32)
    s = scale.to(torch.float32)
    full_r, full_c = rows // FP8_BLOCK * FP8_BLOCK, cols // FP8_BLOCK * FP8_BLOCK
    if full_r and full_c:
        body = out[:full_r, :full_c].unflatten(0, (-1, FP8_BLOCK)).unflatten(2, (-1, FP8_BLOCK))
        body.mul_(s[: full_r // FP8_BLOCK, : full_c // FP8_BLOCK, None][:, None, :, :])
    if full_r < rows:  # the partial last row of blocks
        out[full_r:].mul_(s[-1].repeat_interleave(FP8_BLOCK)[:cols])
    if full_c < cols:  # the partial last column of blocks (rows above full_r)
        out[:full_r, full_c:].mul_(s[: full_r // FP8_BLOCK, -1].repeat_interleave(FP8_BLOCK).unsqueeze(-1))
    return out


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


def _quantized(hf_param: str, state: Mapping[str, torch.Tensor]):
    """``(weight, scale, dequantizer)`` when ``hf_param`` is a weight the fast paths handle, else None."""
    weight = state[hf_param]
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn) or not hf_param.endswith(".weight"):
        return None
    scale_name = hf_param[: -len(".weight")] + ".scale"
    scale = state[scale_name] if scale_name in state else None
    fast = None if scale is None else _fast_path(weight, scale)
    return None if fast is None else (weight, scale, fast)


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
    (MXFP4) or half (FP8) of the bf16 bytes over the bus and runs the lookups on the device.

    UE8M0 scales take the table path (:func:`scaled_table`). Scales that are not powers of two (fp32, the *-Base
    checkpoints) are applied in fp32 and cast once, as Bridge does. Layouts the validation accepts
    (``[ceil(o/128), ceil(i/128)]`` FP8 block scales, ``[o, i/32]`` MXFP4 scales) take these paths; anything else is
    handed to ``fallback``, Megatron-Bridge's function."""
    if isinstance(hf_param, dict):
        return {
            k: dequantize_official(v, state, dtype=dtype, fallback=fallback, device=device) for k, v in hf_param.items()
        }
    quantized = _quantized(hf_param, state)
    if quantized is None:
        return fallback(hf_param, state, dtype=dtype)
    weight, scale, fast = quantized
    if device is not None:
        weight, scale = weight.to(device), scale.to(device)
    return fast(weight, scale, dtype=dtype)


def dequantizer_into(hf_param: str, state: Mapping[str, torch.Tensor]) -> Callable[[torch.Tensor], None] | None:
    """For a weight the fast paths handle: a function writing its dequantized values (what
    :func:`dequantize_official` returns) into a given contiguous tensor, in that tensor's dtype and on its device.
    None for anything else (plain tensors, layouts left to Megatron-Bridge)."""
    quantized = _quantized(hf_param, state)
    if quantized is None:
        return None
    weight, scale, fast = quantized

    def write(out: torch.Tensor) -> None:
        want = (weight.shape[0], weight.shape[1] * (2 if fast is dequantize_mxfp4 else 1))
        if tuple(out.shape) != want or not out.is_contiguous():
            raise ValueError(f"{hf_param}: dequantizes to {want}, cannot write into {tuple(out.shape)}")
        fast(weight.to(out.device), scale.to(out.device), dtype=out.dtype, out=out)

    return write


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
