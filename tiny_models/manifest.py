"""Tensor manifests in the official DeepSeek-V4 on-disk layout, for any V4 config (tiny to Pro).

``manifest(cfg)`` lists every tensor (name, shape, safetensors dtype) a checkpoint of ``cfg`` holds,
computed from the config alone (no weights). ``with_scales=True`` gives the quantized instruct layout
(docs/reference/v4_architecture.md §3.2-3.3): FP8 E4M3 weights with ``[ceil(o/128), ceil(i/128)]`` F8_E8M0 ``.scale``
companions, routed experts MXFP4 (I8 ``[o, i/2]`` + F8_E8M0 ``[o, i/32]``). ``manifest_of_checkpoint``
reads the same triple from safetensors headers only, so it also works on a full-size checkpoint.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from transformers import DeepseekV4Config

from tiny_models.errors import ManifestError

__all__ = [
    "TensorSpec",
    "manifest",
    "manifest_of_checkpoint",
    "storage_dtype",
    "dtype_counts",
    "SAFETENSORS_DTYPES",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
]

FP8_BLOCK = 128  # FP8 block-scale tile (both dims)
MXFP4_BLOCK = 32  # MXFP4 scale group along the input dim

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
}


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: F32, BF16, F8_E4M3, F8_E8M0, I64, I8, ...


# Storage families (docs/reference/v4_architecture.md §3.3).
_F32 = "f32"  # attn_sink, ape, hc_*, gate.bias: fp32 on disk whatever the weight dtype
_I64 = "i64"  # tid2eid
_PLAIN = "plain"  # weights kept unquantized: embed/head/norms/gate/compressor/indexer weights_proj
_FP8 = "fp8"  # FP8 E4M3 + 128x128 block scale when quantized
_FP4 = "fp4"  # routed experts: MXFP4 when quantized


def _family(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("attn_sink", "ape") or leaf.startswith("hc_") or name.endswith("gate.bias"):
        return _F32
    if leaf == "tid2eid":
        return _I64
    if ".ffn.experts." in name:
        return _FP4
    if name.endswith(
        (
            "attn.wq_a.weight",
            "attn.wq_b.weight",
            "attn.wkv.weight",
            "attn.wo_a.weight",
            "attn.wo_b.weight",
            "attn.indexer.wq_b.weight",
            "e_proj.weight",
            "h_proj.weight",
        )
    ) or (".ffn.shared_experts." in name):
        return _FP8
    return _PLAIN


def _as_safetensors_dtype(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        if dtype not in SAFETENSORS_DTYPES.values():
            raise ManifestError(
                f"dtype {dtype!r} is not a safetensors dtype; use one of {sorted(set(SAFETENSORS_DTYPES.values()))}"
            )
        return dtype
    try:
        return SAFETENSORS_DTYPES[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} has no safetensors name; use one of {list(SAFETENSORS_DTYPES)}") from None


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The unquantized on-disk dtype of official tensor ``name`` when weights are stored in ``dtype``."""
    family = _family(name)
    if family == _F32:
        return torch.float32
    if family == _I64:
        return torch.int64
    return dtype


def _layer(prefix: str, cfg: DeepseekV4Config, kind: str, is_hash: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, unquantized shape) of one decoder layer, in structural order."""
    d, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Q, G, R = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, inter, k, V, n = (
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
        cfg.vocab_size,
        cfg.hc_mult,
    )
    M = (2 + n) * n
    yield f"{prefix}attn_norm.weight", (d,)
    yield f"{prefix}ffn_norm.weight", (d,)
    for site in ("attn", "ffn"):
        yield f"{prefix}hc_{site}_fn", (M, n * d)
        yield f"{prefix}hc_{site}_base", (M,)
        yield f"{prefix}hc_{site}_scale", (3,)
    a = f"{prefix}attn."
    yield f"{a}attn_sink", (H,)
    yield f"{a}wq_a.weight", (Q, d)
    yield f"{a}q_norm.weight", (Q,)
    yield f"{a}wq_b.weight", (H * D, Q)
    yield f"{a}wkv.weight", (D, d)
    yield f"{a}kv_norm.weight", (D,)
    yield f"{a}wo_a.weight", (G * R, H * D // G)
    yield f"{a}wo_b.weight", (d, G * R)
    if kind != "sliding_attention":
        m = int(cfg.compress_rates[kind])
        c = 2 if kind == "compressed_sparse_attention" else 1  # CSA windows overlap (two series)
        yield f"{a}compressor.ape", (m, c * D)
        yield f"{a}compressor.wkv.weight", (c * D, d)
        yield f"{a}compressor.wgate.weight", (c * D, d)
        yield f"{a}compressor.norm.weight", (D,)
    if kind == "compressed_sparse_attention":
        IH, ID, m = cfg.index_n_heads, cfg.index_head_dim, int(cfg.compress_rates[kind])
        yield f"{a}indexer.wq_b.weight", (IH * ID, Q)
        yield f"{a}indexer.weights_proj.weight", (IH, d)  # on-disk flat name (transformers: scorer.weights_proj)
        yield f"{a}indexer.compressor.ape", (m, 2 * ID)
        yield f"{a}indexer.compressor.wkv.weight", (2 * ID, d)
        yield f"{a}indexer.compressor.wgate.weight", (2 * ID, d)
        yield f"{a}indexer.compressor.norm.weight", (ID,)
    f = f"{prefix}ffn."
    yield f"{f}gate.weight", (E, d)
    if is_hash:
        yield f"{f}gate.tid2eid", (V, k)
    else:
        yield f"{f}gate.bias", (E,)
    yield f"{f}shared_experts.w1.weight", (inter, d)
    yield f"{f}shared_experts.w2.weight", (d, inter)
    yield f"{f}shared_experts.w3.weight", (inter, d)
    for e in range(E):
        yield f"{f}experts.{e}.w1.weight", (inter, d)
        yield f"{f}experts.{e}.w2.weight", (d, inter)
        yield f"{f}experts.{e}.w3.weight", (inter, d)


def _unquantized(cfg: DeepseekV4Config, include_mtp: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    if cfg.n_shared_experts != 1:
        raise ManifestError(
            f"n_shared_experts={cfg.n_shared_experts}: DeepSeek-V4 (official code and transformers) has exactly one "
            "shared expert of width moe_intermediate_size; build the config with n_shared_experts=1"
        )
    d, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    yield "embed.weight", (V, d)
    yield "head.weight", (V, d)
    yield "norm.weight", (d,)
    yield "hc_head_fn", (n, n * d)
    yield "hc_head_base", (n,)
    yield "hc_head_scale", (1,)
    for i in range(cfg.num_hidden_layers):
        yield from _layer(f"layers.{i}.", cfg, cfg.layer_types[i], cfg.mlp_layer_types[i] == "hash_moe")
    if not include_mtp:
        return
    for j in range(cfg.num_nextn_predict_layers or 0):
        p = f"mtp.{j}."
        # The MTP block is a sliding-only (ratio 0), score-routed layer (its id >= num_hash_layers).
        yield from _layer(p, cfg, "sliding_attention", False)
        yield f"{p}e_proj.weight", (d, d)
        yield f"{p}h_proj.weight", (d, d)
        yield f"{p}enorm.weight", (d,)
        yield f"{p}hnorm.weight", (d,)
        yield f"{p}norm.weight", (d,)
        yield f"{p}hc_head_fn", (n, n * d)
        yield f"{p}hc_head_base", (n,)
        yield f"{p}hc_head_scale", (1,)


def manifest(
    cfg: DeepseekV4Config,
    *,
    with_scales: bool = False,
    include_mtp: bool = True,
    dtype: torch.dtype | str | None = None,
) -> list[TensorSpec]:
    """Every tensor of an official-layout checkpoint of ``cfg``, in structural order.

    ``dtype`` is the storage dtype of the unquantized weights (default F32, or BF16 with ``with_scales``);
    fp32 families (``attn_sink``, ``ape``, ``hc_*``, ``gate.bias``) stay F32 and ``tid2eid`` I64.
    With ``with_scales`` the FP8 families become F8_E4M3 + ``.scale`` and routed experts MXFP4.
    """
    plain = _as_safetensors_dtype(dtype if dtype is not None else (torch.bfloat16 if with_scales else torch.float32))
    specs: list[TensorSpec] = []
    for name, shape in _unquantized(cfg, include_mtp):
        family = _family(name)
        if family == _F32:
            specs.append(TensorSpec(name, shape, "F32"))
        elif family == _I64:
            specs.append(TensorSpec(name, shape, "I64"))
        elif not with_scales or family == _PLAIN:
            specs.append(TensorSpec(name, shape, plain))
        elif family == _FP8:
            o, i = shape
            specs.append(TensorSpec(name, shape, "F8_E4M3"))
            scale = (math.ceil(o / FP8_BLOCK), math.ceil(i / FP8_BLOCK))
            specs.append(TensorSpec(name.removesuffix("weight") + "scale", scale, "F8_E8M0"))
        else:  # _FP4: two e2m1 nibbles per int8 byte, one E8M0 scale per 32 inputs
            o, i = shape
            if i % MXFP4_BLOCK:
                raise ManifestError(
                    f"{name}: MXFP4 packing needs the input dim ({i}) divisible by {MXFP4_BLOCK}; "
                    "use with_scales=False or a config whose hidden_size and moe_intermediate_size are multiples of 32"
                )
            specs.append(TensorSpec(name, (o, i // 2), "I8"))
            specs.append(TensorSpec(name.removesuffix("weight") + "scale", (o, i // MXFP4_BLOCK), "F8_E8M0"))
    return specs


def manifest_of_checkpoint(ckpt_dir: str | Path) -> list[TensorSpec]:
    """(name, shape, dtype) of every tensor in ``ckpt_dir/*.safetensors``, from the headers only."""
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise ManifestError(f"no *.safetensors file in {ckpt_dir}; pass a checkpoint directory")
    specs: list[TensorSpec] = []
    seen: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in seen:
                    raise ManifestError(f"tensor {name} appears in both {seen[name].name} and {path.name}")
                seen[name] = path
                sl = fh.get_slice(name)
                specs.append(TensorSpec(name, tuple(int(x) for x in sl.get_shape()), sl.get_dtype()))
    return specs


def dtype_counts(specs: Iterable[TensorSpec]) -> dict[str, int]:
    """How many tensors of each safetensors dtype."""
    return dict(Counter(s.dtype for s in specs))
