"""Quantized tiny checkpoints in the official DeepSeek-V4 layout, and their exact values.

Formats: ``docs/reference/v4_architecture.md`` §3.3.

``quantize_state`` turns an unquantized official state dict into the quantized one: the FP8 families of
:func:`tiny_models.manifest.manifest` (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, ``indexer.wq_b``, shared
experts, MTP ``e_proj`` / ``h_proj``) become ``float8_e4m3fn`` with one ``<name>.scale`` per 128x128 block
(UE8M0 ``float8_e8m0fnu`` powers of two, or fp32 as in the *-Base checkpoints); routed experts become MXFP4 (int8
bytes holding two e2m1 codes, low nibble = even column, UE8M0 scale per 32 inputs, ``[out, in/32]``) or FP8.
``dequantize_state`` is an independent reference (no Megatron-Bridge code) of what a loader must produce:
``fp8 * scale`` and ``e2m1 * 2**e`` are exact in fp32.

Everything here is pure torch; no megatron import.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config

from tiny_models.manifest import FP8_BLOCK, MXFP4_BLOCK, manifest
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import tiny_config, tiny_fields

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dequantize_state",
    "quant_config",
    "quantize_fp8",
    "quantize_mxfp4",
    "quantize_state",
    "write_quantized_checkpoint",
]

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_DTYPES = {"ue8m0": torch.float8_e8m0fnu, "fp32": torch.float32}


def quant_config() -> DeepseekV4Config:
    """A tiny V4 config whose weights span several 128x128 blocks (some partial) and whose expert inputs are
    multiples of 32: hidden 160 = 128 + 32, q_lora_rank 144, wq_b out 2*96 = 192, expert intermediate 64
    (the ``[quant]`` table of ``tiny_models/presets.toml``)."""
    return tiny_config(**tiny_fields("quant"))


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _block_scale(amax: torch.Tensor, qmax: float, scale_dtype: torch.dtype) -> torch.Tensor:
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return _pow2_ceil(scale) if scale_dtype == torch.float8_e8m0fnu else scale


def quantize_fp8(weight: torch.Tensor, *, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple:
    """``(float8_e4m3fn weight, [ceil(o/128), ceil(i/128)] scale)`` with ``weight ~= q * scale`` per block."""
    w = weight.float()
    o, i = w.shape
    sr, sc = math.ceil(o / FP8_BLOCK), math.ceil(i / FP8_BLOCK)
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    scale = torch.empty(sr, sc, dtype=torch.float32)
    for bi in range(sr):
        for bj in range(sc):
            rows, cols = slice(bi * FP8_BLOCK, (bi + 1) * FP8_BLOCK), slice(bj * FP8_BLOCK, (bj + 1) * FP8_BLOCK)
            block = w[rows, cols]
            s = _block_scale(block.abs().amax(), FP8_E4M3_MAX, scale_dtype)
            q[rows, cols] = (block / s).to(torch.float8_e4m3fn)
            scale[bi, bj] = s
    return q, scale.to(scale_dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per 128x128 block, computed in fp32."""
    o, i = q.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:o, :i]
    return (q.float() * s).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple:
    """``(int8 [o, i/2] packed e2m1 codes, float8_e8m0fnu [o, i/32] scale)``; nearest e2m1 value per element."""
    w = weight.float()
    o, i = w.shape
    if i % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dim divisible by {MXFP4_BLOCK}, got weight shape {tuple(w.shape)}")
    groups = w.view(o, i // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _block_scale(groups.abs().amax(-1), E2M1_MAX, torch.float8_e8m0fnu)
    normalized = (groups / scale[..., None]).view(o, i)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (normalized.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude (ties: the smaller)
    codes = codes | ((normalized < 0).to(torch.int64) << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # low nibble = even column
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack the e2m1 nibbles and multiply each group of 32 by its power-of-two scale, in fp32."""
    b = packed.view(torch.uint8).to(torch.int64)
    table = torch.tensor(E2M1_VALUES)
    values = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(b.shape[0], -1)
    return (values * scale.float().repeat_interleave(MXFP4_BLOCK, 1)).to(dtype)


def quantize_state(
    tensors: dict[str, torch.Tensor],
    cfg: DeepseekV4Config,
    *,
    scale_dtype: str = "ue8m0",
    experts: str = "mxfp4",
) -> dict[str, torch.Tensor]:
    """The quantized official state: which tensors get quantized is read off ``manifest(cfg, with_scales=True)``.

    ``scale_dtype``: ``"ue8m0"`` (instruct) or ``"fp32"`` (*-Base) for the FP8 scales; ``experts``: ``"mxfp4"``
    (instruct) or ``"fp8"`` (*-Base). Unquantized tensors pass through unchanged.
    """
    sdt = SCALE_DTYPES[scale_dtype]
    if experts not in ("mxfp4", "fp8"):
        raise ValueError(f"experts={experts!r}: use 'mxfp4' or 'fp8'")
    quantized = {spec.name: spec.dtype for spec in manifest(cfg, with_scales=True) if spec.name in tensors}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        kind = quantized.get(name)
        scale_name = name.removesuffix("weight") + "scale"
        if kind == "F8_E4M3" or (kind == "I8" and experts == "fp8"):
            out[name], out[scale_name] = quantize_fp8(t, scale_dtype=sdt)
        elif kind == "I8":
            out[name], out[scale_name] = quantize_mxfp4(t)
        else:
            out[name] = t
    return {n: t.contiguous() for n, t in out.items()}


def dequantize_state(
    tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Reference dequantization of a quantized official state (``.scale`` entries consumed); plain tensors as-is."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "scale") if name.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8(t, scale, dtype=dtype)
        elif t.dtype == torch.int8:
            out[name] = dequantize_mxfp4(t, scale, dtype=dtype)
        else:
            out[name] = t
    return out


def write_quantized_checkpoint(
    cfg: DeepseekV4Config | str | None,
    out_dir: str | Path,
    *,
    seed: int = 0,
    scale_dtype: str = "ue8m0",
    experts: str = "mxfp4",
) -> Path:
    """``write_checkpoint`` then quantize ``model.safetensors`` in place (``config.json`` unchanged).

    ``cfg=None`` uses :func:`quant_config`. Same arguments -> byte-identical files.
    """
    cfg = quant_config() if cfg is None else cfg
    out = write_checkpoint(cfg, out_dir, seed=seed)
    path = out / "model.safetensors"
    hf_cfg = DeepseekV4Config.from_pretrained(str(out))
    tensors = quantize_state(load_file(str(path)), hf_cfg, scale_dtype=scale_dtype, experts=experts)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out
