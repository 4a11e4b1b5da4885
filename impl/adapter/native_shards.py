"""A LoRA checkpoint saved rank by rank from a Megatron model (Miles' native format) as one full adapter state.

It mirrors Miles' ``save_lora_checkpoint``, known from its source because Miles does not install on a CPU host, and
reassembles the shards as Megatron-Bridge's ``ParallelLinearAdapter`` splits them. Data-parallel replicas must agree
bit for bit. The format and the reassembly rules: :func:`read_native_shards`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from impl.adapter.build import AdapterState
from impl.adapter.dialects import native_adapter_name, native_name, parse_native
from impl.errors import NativeShardError, PickleAdapterError
from impl.vocabulary import ParallelStyle

__all__ = ["NativeShardError", "is_native_shard_dir", "read_native_shards"]

_LEGACY = re.compile(r"adapter_megatron_tp(\d+)_pp(\d+)\.pt")
_BY_RANK = re.compile(r"adapter_megatron_rank(\d+)\.pt")
_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(\.)")


def is_adapter_param_name(name: str) -> bool:
    """Miles' ``_is_adapter_param_name``: what its shards hold."""
    return "lora_" in name or (".adapter." in name and ("linear_in" in name or "linear_out" in name))


def is_native_shard_dir(src: Path) -> bool:
    return any(_LEGACY.fullmatch(p.name) or _BY_RANK.fullmatch(p.name) for p in Path(src).glob("adapter_megatron_*"))


def _positions(src: Path, tp: int | None, pp: int | None) -> dict[tuple[int, int], list[Path]]:
    """(tp rank, pp rank) -> the files holding it (several: data-parallel replicas)."""
    legacy = {p: _LEGACY.fullmatch(p.name) for p in src.glob("adapter_megatron_tp*_pp*.pt")}
    ranked = {p: _BY_RANK.fullmatch(p.name) for p in src.glob("adapter_megatron_rank*.pt")}
    if legacy and ranked:
        raise NativeShardError(f"{src}: holds both tp/pp-named and rank-named shards; keep one checkpoint per folder")
    out: dict[tuple[int, int], list[Path]] = {}
    if legacy:
        for p, m in legacy.items():
            out.setdefault((int(m[1]), int(m[2])), []).append(p)
        return out
    world = len(ranked)
    if tp is None or pp is None:
        raise NativeShardError(
            f"{src}: {world} rank-named shards (adapter_megatron_rank*.pt); which rank holds which tensor-parallel "
            "and pipeline rank is the run's layout: give --tp and --pp as the run used them"
        )
    ranks = sorted(int(m[1]) for m in ranked.values())
    if ranks != list(range(world)) or world % (tp * pp):
        raise NativeShardError(f"{src}: ranks {ranks} do not make a world of tp={tp} x pp={pp} x data-parallel")
    per_stage = world // pp
    for p, m in ranked.items():
        r = int(m[1])
        out.setdefault((r % tp, r // per_stage), []).append(p)
    return out


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses code-carrying pickles; a corrupt file fails too
        raise PickleAdapterError(f"{file}: torch.load(weights_only=True) refused it ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise PickleAdapterError(f"{file}: holds a {type(obj).__name__}, not a flat dict of parameter tensors")
    out = {}
    for name, t in obj.items():
        if not is_adapter_param_name(name):
            continue
        out[native_adapter_name(name)] = t.detach().clone()
    return out


def _replica(position: tuple[int, int], files: list[Path]) -> dict[str, torch.Tensor]:
    first, *rest = (_load(f) for f in sorted(files))
    for f, other in zip(sorted(files)[1:], rest, strict=True):
        if other.keys() != first.keys():
            raise NativeShardError(f"{f}: holds other adapter parameters than its replica {sorted(files)[0].name}")
        bad = [n for n in first if not torch.equal(first[n], other[n])]
        if bad:
            raise NativeShardError(f"{f}: {bad[0]} differs from its data-parallel replica (tp, pp) = {position}")
    return first


def _stage_layers(stages: Mapping[int, set[int]]) -> dict[int, int]:
    """pp rank -> the offset of its layer numbers: 0 where stages number globally (disjoint sets), else the layers of
    the stages before it (Megatron's local numbering: every stage starts at 0)."""
    sets = [stages[p] for p in sorted(stages)]
    disjoint = sum(map(len, sets)) == len(set().union(*sets))
    if disjoint and len(sets) > 1:
        return dict.fromkeys(stages, 0)
    offsets, seen = {}, 0
    for p in sorted(stages):
        offsets[p] = seen
        seen += max(stages[p], default=-1) + 1
    return offsets


def read_native_shards(src: str | Path, *, alpha: float, tp: int | None = None, pp: int | None = None) -> AdapterState:
    """The full adapter state of the native shards in ``src``; ``alpha`` is the run's LoRA alpha (the shards do not
    hold it).

    The format, as Miles' ``save_lora_checkpoint`` writes it (radixark/miles @7fb0c40a, read from its source; Miles
    does not install on a CPU host, so it is known from that layout, not run): every rank ``torch.save``s a flat
    ``{parameter name: tensor}`` of the adapter parameters it holds (names with ``lora_``, or ``.adapter.`` and
    ``linear_in``/``linear_out``) as ``adapter_megatron_tp{t}_pp{p}.pt`` (the legacy name) or
    ``adapter_megatron_rank{r}.pt`` (HEAD). Which rank holds which (tp, pp) is the run's layout: ``tp`` and ``pp``
    must be given, ranks ordered as Megatron's default ``tp-cp-ep-dp-pp``. Names are the model's own
    ``named_parameters``: wrapper prefixes (``module.``), Megatron-Bridge LoRA's ``.to_wrap`` hops, and layer numbers
    local to the pipeline stage in Megatron's ``TransformerBlock`` (global in :mod:`impl.native`'s graph; both are
    read).

    Reassembly follows Megatron-Bridge's ``ParallelLinearAdapter`` (the same facts :mod:`impl.adapter.gather` reads
    from each parameter's ``partition_dim`` at run time): every lora_A and lora_B is split along dim 0 over the TP
    group, except the row-parallel ``wo_b``'s lora_A, split along dim 1. Data-parallel replicas must agree bit for
    bit.
    """
    src = Path(src)
    positions = _positions(src, tp, pp)
    if not positions:
        raise NativeShardError(f"{src}: no adapter_megatron_*.pt shards")
    tps = sorted({t for t, _ in positions})
    pps = sorted({p for _, p in positions})
    missing = [(t, p) for t in tps for p in pps if (t, p) not in positions]
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or missing:
        raise NativeShardError(f"{src}: shards of (tp, pp) {missing or 'ranks out of sequence'} are missing")
    held = {pos: _replica(pos, files) for pos, files in positions.items()}
    layers = {p: {int(m[2]) for n in held[(0, p)] if (m := _LAYER.search(n))} for p in pps}
    offsets = _stage_layers(layers)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[str, int] = {}
    for p in pps:
        for name in sorted(held[(0, p)]):
            parts = [held[(t, p)].get(name) for t in tps]
            if any(x is None for x in parts):
                raise NativeShardError(f"{src}: {name} is missing from a tensor-parallel rank of stage {p}")
            parsed = parse_native(_LAYER.sub(lambda m, o=offsets[p]: f"{m[1]}{int(m[2]) + o}{m[3]}", name, count=1))
            full = native_name(parsed.layer, parsed.row, parsed.half)
            dim = 1 if parsed.row.parallel is ParallelStyle.ROW and parsed.half == "A" else 0
            try:
                tensors[full] = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
            except RuntimeError as exc:
                raise NativeShardError(
                    f"{src}: the tensor-parallel shards of {name} (stage {p}) do not fit ({exc})"
                ) from None
            if full in seen:
                raise NativeShardError(f"{src}: {full} is held by stages {seen[full]} and {p}")
            seen[full] = p
    ranks = {t.shape[0] for n, t in tensors.items() if parse_native(n).half == "A"}
    if len(ranks) != 1:
        raise NativeShardError(f"{src}: lora_A ranks {sorted(ranks)} differ across modules")
    return AdapterState(tensors, r=ranks.pop(), alpha=alpha)
