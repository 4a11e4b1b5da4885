"""The loader's FP8 / MXFP4 dequantization gives Megatron-Bridge's values bit for bit (only faster).

Reference: Megatron-Bridge 0.6.2 ``maybe_dequantize_hf_quantized_weight`` (what the loader used before) and, for the
values themselves, ``tiny_models.quantize``'s independent fp32 dequantizers. Every byte code, every non-NaN FP8 code,
UE8M0 scales from 2**-127 to 2**127 (overflow to inf included), fp32 (*-Base) scales, shapes that are not multiples
of the 128 / 32 blocks, in bf16 and fp32.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.runner.host_state import torch_threads
from tiny_models.quantize import dequantize_fp8, dequantize_mxfp4

pytestmark = pytest.mark.cpu

DTYPES = [torch.bfloat16, torch.float32]


def _bridge(impl, name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    impl.compat_report()  # the compat layer precedes every megatron import
    from megatron.bridge.models.conversion.quantization_utils import maybe_dequantize_hf_quantized_weight

    return maybe_dequantize_hf_quantized_weight(name, {name: weight, name[:-6] + "scale": scale}, dtype=dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(
            got.view(torch.int16 if got.dtype.itemsize == 2 else torch.int32),
            want.view(torch.int16 if want.dtype.itemsize == 2 else torch.int32),
        )
    )


def _e8m0(shape, gen, low=0, high=255) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int16).to(torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "cols"), [(64, 256), (70, 96)], ids=["whole-blocks", "odd-rows"])
@pytest.mark.parametrize("exponents", [(120, 135), (0, 255), None], ids=["typical", "full-range", "fp32-scales"])
def test_mxfp4_matches_megatron_bridge_bit_for_bit(impl, dtype, rows, cols, exponents):
    gen = torch.Generator().manual_seed(rows + cols)
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int16).to(torch.int8)
    packed[0, : min(256, cols // 2)] = torch.arange(-128, 128, dtype=torch.int16)[: min(256, cols // 2)].to(torch.int8)
    if exponents is None:  # not powers of two: applied in fp32 and cast once, as Bridge does
        scale = torch.rand((rows, cols // 32), generator=gen) * 1e-2 + 1e-4
    else:
        scale = _e8m0((rows, cols // 32), gen, *exponents)
    got = impl.dequantize_mxfp4(packed, scale, dtype=dtype)
    into = impl.dequantize_mxfp4(packed, scale, dtype=dtype, out=torch.full_like(got, float("nan")))
    assert _same(into, got), f"MXFP4 {rows}x{cols} {dtype}: written into a given tensor, the values differ"
    want = _bridge(impl, "experts.0.w1.weight", packed, scale, dtype)
    assert _same(got, want), (
        f"MXFP4 {rows}x{cols} {dtype}: differs from Megatron-Bridge at {(got != want).sum()} places"
    )
    reference = dequantize_mxfp4(packed, scale, dtype=dtype)
    finite = torch.isfinite(reference)
    assert torch.equal(got[finite], reference[finite]), "MXFP4 values differ from tiny_models' reference"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "cols"), [(256, 384), (200, 300), (100, 130)], ids=["whole", "partial", "one-row"])
@pytest.mark.parametrize("scale_kind", ["ue8m0", "fp32"])
def test_fp8_block_scaled_matches_megatron_bridge_bit_for_bit(impl, dtype, rows, cols, scale_kind):
    gen = torch.Generator().manual_seed(rows * cols)
    codes = torch.randint(0, 127, (rows, cols), generator=gen, dtype=torch.int16)
    codes |= torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int16) << 7
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    blocks = (-(-rows // 128), -(-cols // 128))
    if scale_kind == "ue8m0":
        scale = _e8m0(blocks, gen, 100, 150)
    else:  # the *-Base checkpoints' fp32 scales: not powers of two
        scale = torch.rand(blocks, generator=gen) * 1e-2 + 1e-4
    got = impl.dequantize_fp8_blocks(weight, scale, dtype=dtype)
    into = impl.dequantize_fp8_blocks(weight, scale, dtype=dtype, out=torch.full_like(got, float("nan")))
    assert _same(into, got), f"FP8 {rows}x{cols} {dtype} {scale_kind}: written into a given tensor, values differ"
    want = _bridge(impl, "attn.wq_b.weight", weight, scale, dtype)
    assert _same(got, want), f"FP8 {rows}x{cols} {dtype} {scale_kind}: differs at {(got != want).sum()} places"
    reference = dequantize_fp8(weight, scale, dtype=dtype)
    assert _same(got, reference), "FP8 values differ from tiny_models' reference"


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_a_weight_split_over_threads_dequantizes_to_megatron_bridges_bits(impl, threads, fmt):
    """Large weights are gathered by one thread per torch thread (uneven parts, a partial last row block)."""
    gen = torch.Generator().manual_seed(threads)
    if fmt == "mxfp4":
        weight = torch.randint(-128, 128, (1536, 1024), generator=gen, dtype=torch.int16).to(torch.int8)
        scale = _e8m0((1536, 2048 // 32), gen, 110, 140)
        with torch_threads(threads):
            got = impl.dequantize_mxfp4(weight, scale, dtype=torch.bfloat16)
    else:
        codes = torch.randint(0, 127, (1500, 1100), generator=gen, dtype=torch.int16)
        weight = (codes | torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.int16) << 7).to(torch.uint8)
        weight = weight.view(torch.float8_e4m3fn)
        scale = _e8m0((12, 9), gen, 110, 140)
        with torch_threads(threads):
            got = impl.dequantize_fp8_blocks(weight, scale, dtype=torch.bfloat16)
    want = _bridge(impl, "w.weight", weight, scale, torch.bfloat16)
    assert _same(got, want), f"{fmt} over {threads} threads: differs at {(got != want).sum()} places"
