"""DeepSeek-V4 rotary embedding: interleaved pairs on the LAST ``rope_head_dim`` channels of a head.

Op order follows transformers' ``DeepseekV4RotaryEmbedding`` / ``apply_rotary_pos_emb`` so fp32 results agree bit for
bit. Which theta and YaRN each layer uses: :func:`rope_inv_freq`. Rope fusion is asked for by the recipe and decided
by :func:`decide_rope_fusion`: the native graph runs this PyTorch rope and names why whenever fusion was asked for."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from impl.native.config import V4Config

__all__ = [
    "ROPE_FUSION_FALLBACKS",
    "RopeFusion",
    "RopeFusionFallback",
    "RopeFusionFallbackWarning",
    "apply_interleaved_rope",
    "decide_rope_fusion",
    "rope_inv_freq",
]


@dataclass(frozen=True)
class RopeFusionFallback:
    """Why the native graph runs its rope unfused although the recipe asked for fusion."""

    name: str
    reason: str


#: The reasons, in the order they are checked (the first that holds is the one named).
ROPE_FUSION_FALLBACKS: dict[str, RopeFusionFallback] = {
    row.name: row
    for row in (
        RopeFusionFallback(
            "no-cuda",
            "fused rope kernels (Transformer Engine's fused_apply_rotary_pos_emb, Megatron-Core's fused MLA YaRN "
            "rope) run on CUDA only",
        ),
        RopeFusionFallback(
            "no-v4-kernel",
            "no fused kernel covers V4's rope: interleaved pairs on the trailing rope_head_dim channels of q, kv, "
            "the compressor and the indexer, and the conjugate rotation of the attention output; Transformer "
            "Engine's fused rope rotates the leading channels and Megatron-Core's fused MLA rope reads MLA's "
            "separate q/k positional parts, so the native graph keeps this rope (the reference's numerics)",
        ),
    )
}


class RopeFusionFallbackWarning(UserWarning):
    """Rope fusion was asked for and the native graph runs unfused; the message names the fallback row."""


#: Whether the native graph has a fused rope path (it has none: :data:`ROPE_FUSION_FALLBACKS`).
NATIVE_ROPE_FUSED = False


@dataclass(frozen=True)
class RopeFusion:
    """What became of a rope-fusion request: ``applied``, or the ``fallback`` that says why not."""

    requested: bool
    applied: bool
    fallback: RopeFusionFallback | None = None


def decide_rope_fusion(requested: bool) -> RopeFusion:
    """The native graph's answer to ``apply_rope_fusion=requested`` on this host (warns when it falls back).

    Megatron's ``apply_rope_fusion`` is on in upstream's V4 SFT recipes since #4305; the native graph runs the
    PyTorch rope and names why (:data:`ROPE_FUSION_FALLBACKS`) whenever fusion was asked for.
    """
    decision = _rope_fusion(requested)
    if decision.fallback is not None:
        warnings.warn(
            f"apply_rope_fusion=True: the native DeepSeek-V4 graph runs its rope unfused "
            f"({decision.fallback.name}): {decision.fallback.reason}",
            RopeFusionFallbackWarning,
            stacklevel=2,
        )
    return decision


def _rope_fusion(requested: bool) -> RopeFusion:
    if not requested:
        return RopeFusion(requested=False, applied=False)
    if not torch.cuda.is_available():
        return RopeFusion(requested=True, applied=False, fallback=ROPE_FUSION_FALLBACKS["no-cuda"])
    if not NATIVE_ROPE_FUSED:
        return RopeFusion(requested=True, applied=False, fallback=ROPE_FUSION_FALLBACKS["no-v4-kernel"])
    return RopeFusion(requested=True, applied=True)


def rope_inv_freq(cfg: V4Config, *, compressed: bool, device: torch.device | None = None) -> torch.Tensor:
    """fp32 inverse frequencies ``[rope_head_dim // 2]`` (one per interleaved pair).

    Ratio-0 (sliding-only and MTP) layers use ``rope_theta`` without YaRN; compressed layers (ratio > 0) use
    ``compress_rope_theta`` with YaRN for q/kv, the compressor and the indexer alike, and no attention-scale
    (mscale) correction. The rotary width is always ``rope_head_dim`` (``qk_rope_head_dim``), never a
    ``rotary_percent`` of the head dim.
    """
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    if not compressed or cfg.yarn is None:
        return 1.0 / (base**exponents)
    yarn = cfg.yarn
    pos_freqs = base**exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    # transformers truncates the correction range (floor/ceil) by default, as the official code does.
    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = (1 - ramp).to(device=device, dtype=torch.float)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[B, S, rope_head_dim // 2]`` for ``positions [B, S]``, computed in fp32, cast to ``dtype``."""
    inv = inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1).to(positions.device)
    freqs = (inv @ positions[:, None, :].float()).transpose(1, 2)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_interleaved_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs ``(2i, 2i+1)``.

    ``cos``/``sin`` (``[..., S, rd/2]``) must broadcast against ``x[..., rd:]`` once doubled; ``inverse``
    applies the conjugate rotation (used on the attention output). Leading "nope" channels pass through.
    """
    if inverse:
        sin = -sin
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    rope_dim = cos.shape[-1]
    if rope_dim == 0:
        return x
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (_rotate_pairs(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
