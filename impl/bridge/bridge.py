"""Conversion-only Megatron-Bridge bridge for the native DeepSeek-V4 graph: strict load and export.

Every mapping object is a real Megatron-Bridge ``MegatronParamMapping`` built from
:data:`impl.conversion.mapping.MAPPING_TABLE`, so TP scatter/gather, EP gather and PP broadcast are Megatron-Bridge's
own code. Which bridge answers where, per pin: :func:`register`.
"""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, register_bridge_implementation
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    GatedMLPMapping,
    MegatronParamMapping,
    ReplicatedMapping,
    RowParallelMapping,
)
from megatron.bridge.models.conversion.utils import persistent_buffers
from megatron.core import parallel_state
from torch import nn

from impl.adapter.gather import gather_adapter_state, unwrap_chunk
from impl.compat.megatron_bridge import (
    detect_parallelism,
    registered_model_bridge,
    replicate_over_tensor_parallel,
    restore_model_bridge,
)
from impl.conversion.checkpoint_reader import (
    QUANT_PREFIXES,
    QUANTIZED_DTYPES,
    Header,
    LazyState,
    effective_shape,
    maybe_dequantize_hf_quantized_weight,
    quantization_problems,
    read_headers,
)
from impl.conversion.dequant import dequantizer_into, read_official
from impl.conversion.detect import require_deepseek_v4_config
from impl.conversion.landing import landing_views
from impl.conversion.mapping import MAPPING_TABLE, MappingRow, lookup_native, lookup_official, normalize, scale_base
from impl.errors import CheckpointMappingError, QuantizationError

__all__ = [
    "DeepseekV4ConversionBridge",
    "LoadReport",
    "export_merged_state",
    "export_official_state",
    "load_official_checkpoint",
]

SOURCE = "DeepseekV4ForCausalLM"

MAPPING_CLASSES: dict[str, type[MegatronParamMapping]] = {
    "replicated": ReplicatedMapping,
    "column": ColumnParallelMapping,
    "vocab": ColumnParallelMapping,
    "row": RowParallelMapping,
    "auto": AutoMapping,
    "gated_mlp": GatedMLPMapping,
    "replicated_gated_mlp": GatedMLPMapping,  # TP group cleared in mapping_for_row
    "expert_gated_mlp": GatedMLPMapping,
    "expert_row": RowParallelMapping,
}


def mapping_for_row(row: MappingRow) -> MegatronParamMapping:
    """The Megatron-Bridge mapping object (still holding ``*``) for one table row."""
    cls = MAPPING_CLASSES[row.semantics]
    if not row.is_gated:
        return cls(row.native, row.official)
    return _untp(row, cls(row.native, gate=row.official[0], up=row.official[1]))


def _untp(row: MappingRow, mapping: MegatronParamMapping) -> MegatronParamMapping:
    if row.semantics == "replicated_gated_mlp":
        # The native shared expert is a plain replicated module: no TP group means tp_size 1 (concat / split only).
        return replicate_over_tensor_parallel(mapping)
    return mapping


def _resolved(row: MappingRow, native_name: str) -> MegatronParamMapping:
    """The row's mapping with wildcards filled (``resolve`` builds a fresh object, so re-apply ``_untp``)."""
    return _untp(row, mapping_for_row(row).resolve(normalize(native_name)[1]))


def build_v4_mappings() -> list[MegatronParamMapping]:
    """One Megatron-Bridge mapping per table row, in table order."""
    return [mapping_for_row(row) for row in MAPPING_TABLE]


class DeepseekV4ConversionBridge(MegatronModelBridge):
    """Weights only: official DeepSeek-V4 safetensors <-> :class:`DeepseekV4NativeModel` chunks."""

    def provider_bridge(self, hf_pretrained: Any) -> Any:
        """Where Megatron-Bridge's provider lookup dispatches V4 to this bridge (pins without an upstream V4
        bridge), the config goes to the native provider; this bridge itself only converts weights."""
        from impl.native.provider import DeepseekV4NativeProvider

        config = getattr(hf_pretrained, "config", hf_pretrained)
        require_deepseek_v4_config(config)
        return DeepseekV4NativeProvider(hf_config=config)

    def mapping_registry(self) -> MegatronMappingRegistry:
        # V4 rows first: lookups are first-match-wins, and the generic DeepSeek list gives some of the same native
        # names (router, experts, norms, embedding) a V3 (``model.layers.*.mlp.gate``) meaning.
        from megatron.bridge.models.deepseek.common import get_common_mapping_list

        return MegatronMappingRegistry(*build_v4_mappings(), *get_common_mapping_list())

    def maybe_modify_loaded_hf_weight(self, hf_param: str | dict[str, str], hf_state_dict: Mapping[str, Any]) -> Any:
        if maybe_dequantize_hf_quantized_weight is None:
            return super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict)
        return maybe_dequantize_hf_quantized_weight(hf_param, hf_state_dict)


# --------------------------------------------------------------------------------------------------
# registration


def register() -> None:
    """Register with Megatron-Bridge's dispatch (idempotent).

    Registration and dispatch (Megatron-Bridge 0.6.2, ``models/decorators/dispatch.py``): ``register_bridge`` keys
    ``get_model_bridge`` on the *source only* and the three stream dispatchers on the ``(source, target)`` tuple. The
    dispatcher table is a dict, so a second registration with the same source string *replaces* the first
    ``get_model_bridge`` entry (last import wins), while tuples with different targets coexist. Upstream
    ``DeepSeekV4Bridge`` (0.5.0+) registers ``("DeepseekV4ForCausalLM", GPTModel)``; we register
    ``("DeepseekV4ForCausalLM", DeepseekV4NativeModel)`` for the stream dispatchers and then *restore* the upstream
    ``get_model_bridge`` entry, because that one has no model argument and ``AutoBridge`` uses it to build GPTModel
    providers (ours hands the config to the native provider). So per pin:

    * 0.6.2 (and 0.5.x): ``get_model_bridge("DeepseekV4ForCausalLM")`` -> upstream ``DeepSeekV4Bridge``;
      ``stream_*_megatron_to_hf(("DeepseekV4ForCausalLM", DeepseekV4NativeModel), ...)`` -> ours;
      ``(..., GPTModel)`` -> upstream.
    * pins without an upstream V4 bridge (< 0.5.0): ``get_model_bridge`` -> ours as well (nothing to preserve).
    """
    from impl.native.model import DeepseekV4NativeModel

    previous = registered_model_bridge(SOURCE)
    register_bridge_implementation(source=SOURCE, target=DeepseekV4NativeModel, bridge_class=DeepseekV4ConversionBridge)
    DeepseekV4ConversionBridge.SOURCE_NAME = SOURCE
    DeepseekV4ConversionBridge.MODEL_TYPE = "deepseek_v4"
    if previous is not None:  # keep upstream serving AutoBridge / GPTModel (restoring ours, if ours, changes nothing)
        restore_model_bridge(SOURCE, previous)


# --------------------------------------------------------------------------------------------------
# native side: global names, owners


@dataclass(frozen=True)
class _NativeTensor:
    chunk: int
    local: str
    name: str  # global (PP layer offset and EP expert offset applied)
    tensor: torch.Tensor
    module: nn.Module
    n_experts: int | None  # total routed experts, for EP export


def _native_tensors(chunks: list[nn.Module]) -> list[_NativeTensor]:
    out: list[_NativeTensor] = []
    for ci, chunk in enumerate(chunks):
        model = unwrap_chunk(chunk)
        named = [(n, p) for n, p in model.named_parameters() if "_extra_state" not in n]
        named += [(n, b) for n, b in persistent_buffers(model) if "_extra_state" not in n]
        for local, tensor in named:
            if ".adapter." in local:  # LoRA halves belong to the adapter path (impl.adapter.gather), not the base
                continue
            owner_name = local.rpartition(".")[0]
            module = model.get_submodule(owner_name) if owner_name else model
            name, n_experts = _globalize(model, local.replace(".to_wrap.", "."))  # a LoRA-wrapped base linear
            out.append(_NativeTensor(ci, local, name, tensor, module, n_experts))
    return out


def _globalize(model: nn.Module, local: str) -> tuple[str, int | None]:
    # PP needs nothing here: a stage registers its decoder layers under their global numbers (GlobalLayerList).
    parts = local.split(".")
    if "local_experts" not in parts:
        return local, None
    # EP: ``local_experts.{e}`` -> global ``offset + e``.
    i = parts.index("local_experts")
    experts = model.get_submodule(".".join(parts[:i]))
    parts[i + 1] = str(experts.local_expert_offset + int(parts[i + 1]))
    return ".".join(parts), experts.num_experts


# --------------------------------------------------------------------------------------------------
# strict load


@dataclass
class LoadReport:
    """What a strict load did: per-checkpoint-tensor outcome and totals."""

    loaded: list[str] = field(default_factory=list)  # checkpoint tensors consumed (on any rank)
    declared_not_loaded: dict[str, str] = field(default_factory=dict)  # name -> reason
    unmapped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    native_filled: list[str] = field(default_factory=list)  # this rank's native (global) names

    @property
    def totals(self) -> dict[str, int]:
        return {
            "loaded": len(self.loaded),
            "declared_not_loaded": len(self.declared_not_loaded),
            "unmapped": len(self.unmapped),
            "missing": len(self.missing),
            "native_filled": len(self.native_filled),
        }

    def __str__(self) -> str:
        return "LoadReport(" + ", ".join(f"{k}={v}" for k, v in self.totals.items()) + ")"


def _tp_size_of(mapping: MegatronParamMapping) -> int:
    try:
        return mapping.tp_size
    except Exception:  # no group snapshot (single process): unsharded
        return 1


def _ep_size_of(mapping: MegatronParamMapping) -> int:
    try:
        return mapping.ep_size
    except Exception:  # no group snapshot (single process): one EP rank
        return 1


def _expected_official_shapes(nt: _NativeTensor, row: MappingRow, mapping: MegatronParamMapping) -> list[tuple]:
    local = tuple(nt.tensor.shape)
    tp = _tp_size_of(mapping)
    sem = row.semantics
    if sem == "auto":
        sem = {"column": "column", "row": "row"}.get(detect_parallelism(mapping, nt.module), "replicated")
    if sem in ("column", "vocab"):
        return [(local[0] * tp, *local[1:])]
    if sem in ("row", "expert_row"):
        return [local] if len(local) == 1 else [(local[0], local[1] * tp, *local[2:])]
    if sem in ("gated_mlp", "replicated_gated_mlp", "expert_gated_mlp"):
        return [(local[0] * tp // 2, *local[1:])] * 2
    return [local]


def _all_gather(obj: Any) -> list[Any]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _plan_load(
    natives: list[_NativeTensor], headers: dict[str, Header]
) -> tuple[list[tuple[_NativeTensor, MappingRow, MegatronParamMapping]], set[str], list[str]]:
    """This rank's half of the strict load, from headers only: what each native tensor loads from, which
    checkpoint tensors that consumes, and every offender (unmapped, missing, mis-shaped, badly quantized)."""
    offenders: list[str] = []
    plan: list[tuple[_NativeTensor, MappingRow, MegatronParamMapping]] = []
    consumed: set[str] = set()
    for nt in natives:
        hit = lookup_native(nt.name)
        if hit is None:
            offenders.append(
                f"unmapped native tensor {nt.name} {tuple(nt.tensor.shape)}: no row in impl.conversion.mapping"
            )
            continue
        _, row, officials = hit
        mapping = _resolved(row, nt.name)
        ok = True
        for off, exp in zip(officials, _expected_official_shapes(nt, row, mapping), strict=True):
            if off not in headers:
                offenders.append(f"missing {off}: expected shape {exp}, needed by native {nt.name}")
                ok = False
                continue
            got = effective_shape(off, headers)
            if got != exp:  # the native vocabulary is never padded: validate_parallel_layout wants TP to divide it
                offenders.append(f"mis-shaped {off}: expected shape {exp}, got {got} (native {nt.name})")
                ok = False
            consumed.add(off)
            quant = quantization_problems(off, headers)
            offenders += quant
            ok = ok and not quant
            scale = off[: -len(".weight")] + ".scale" if off.endswith(".weight") else None
            if scale in headers:
                consumed.add(scale)
        if ok:
            plan.append((nt, row, mapping))
    return plan, consumed, offenders


def _judge_load(
    ckpt: Path, headers: dict[str, Header], dups: dict[str, list[str]], native_names: list[str], gathered: list
) -> LoadReport:
    """Every rank's plan, agreed: the report of what loads, or one error listing every offender on any rank."""
    all_consumed = set().union(*(set(g[0]) for g in gathered))
    all_offenders = list(dict.fromkeys(o for g in gathered for o in g[1]))
    model_has_mtp = any(g[2] for g in gathered)
    report = LoadReport(native_filled=native_names)
    for name in headers:
        base = scale_base(name)
        if name in all_consumed:
            if base is not None and base in all_consumed:
                report.declared_not_loaded[name] = f"block scale consumed by dequantizing {base}"
            else:
                report.loaded.append(name)
        elif name.startswith("mtp.") and not model_has_mtp:
            report.declared_not_loaded[name] = "model built without MTP layers"
        else:
            hit = lookup_official(name) or (lookup_official(base) if base else None)
            why = "no row in impl.conversion.mapping" if hit is None else f"no native tensor {hit[2]} in this model"
            report.unmapped.append(name)
            all_offenders.append(f"unmapped checkpoint tensor {name} {headers[name].shape}: {why}")
    for name, files in sorted(dups.items()):
        all_offenders.append(f"duplicated checkpoint tensor {name}: present {len(files)} times in {files}")
    report.missing = [o.split()[1].removesuffix(":") for o in all_offenders if o.startswith("missing ")]
    if all_offenders:
        quant_only = all(o.startswith(QUANT_PREFIXES) for o in all_offenders)
        err = (QuantizationError if quant_only else CheckpointMappingError)(
            f"checkpoint {ckpt} does not match the native DeepSeek-V4 model ({len(all_offenders)} offenders); "
            "fix the checkpoint or build the model from its config.json:\n  " + "\n  ".join(all_offenders)
        )
        err.offenders = all_offenders
        err.report = report
        raise err
    return report


def load_official_checkpoint(model_chunks: nn.Module | list[nn.Module], ckpt_dir: str | Path) -> LoadReport:
    """Strictly load an official-layout V4 checkpoint into native model chunks (collective over all ranks).

    Strict load: every checkpoint tensor is loaded, or declared not loaded with a reason (``.scale`` companions consumed
    by dequantization; ``mtp.*`` when the model has no MTP layer); every native parameter and persistent buffer is
    filled; anything else raises one :class:`~impl.errors.CheckpointMappingError` listing all offenders. Validation
    reads safetensors headers only and agrees across ranks before any collective, so a bad checkpoint never hangs."""
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    ckpt = Path(ckpt_dir)
    headers, dups = read_headers(ckpt)
    natives = _native_tensors(chunks)
    native_names = [nt.name for nt in natives]
    plan, consumed, offenders = _plan_load(natives, headers)
    # Agree across ranks before any collective: which tensors some rank consumed, and every offender.
    gathered = _all_gather((sorted(consumed), offenders, any(n.startswith("mtp.") for n in native_names)))
    report = _judge_load(ckpt, headers, dups, native_names, gathered)
    state = LazyState(ckpt, headers)
    with torch.no_grad():
        for nt, row, mapping in plan:
            if not _dequantize_in_place(nt, row, mapping, state, headers):
                _load_through_bridge(nt, mapping, state)
    return report


def _load_through_bridge(nt: _NativeTensor, mapping: MegatronParamMapping, state: LazyState) -> None:
    # Bridge's dequantized values, computed faster, on the parameter's device (impl.conversion.dequant)
    hf = read_official(mapping.hf_param, state, nt.tensor.dtype, nt.tensor.device, maybe_dequantize_hf_quantized_weight)
    converted = mapping.hf_to_megatron(hf, nt.module)
    if converted.shape != nt.tensor.shape:  # defensive: validation should make this unreachable
        raise CheckpointMappingError(
            f"mis-shaped {mapping.hf_param}: native {nt.name} expects {tuple(nt.tensor.shape)}, "
            f"conversion produced {tuple(converted.shape)}"
        )
    nt.tensor.copy_(converted)


def _dequantize_in_place(
    nt: _NativeTensor, row: MappingRow, mapping: MegatronParamMapping, state: LazyState, headers: dict[str, Header]
) -> bool:
    """Quantized inputs that Bridge's mapping only places (no tensor parallelism): dequantized straight into the
    parameter where the mapping puts them (:mod:`impl.conversion.landing`), with no intermediate tensor, no
    concatenation and no copy. False (nothing written) where that does not hold."""
    if maybe_dequantize_hf_quantized_weight is None or _tp_size_of(mapping) != 1:
        return False
    names = mapping.hf_param if isinstance(mapping.hf_param, dict) else {"": mapping.hf_param}
    if any(headers[name].dtype not in QUANTIZED_DTYPES for name in names.values()):
        return False  # decided from the headers: a plain tensor is read once, by Bridge's path
    shapes = {k: effective_shape(name, headers) for k, name in names.items()}
    views = landing_views(row, mapping, nt.module, nt.tensor, shapes)
    if views is None:
        return False
    writers = {k: dequantizer_into(name, state) for k, name in names.items()}
    if any(w is None for w in writers.values()):
        return False
    for k, write in writers.items():
        write(views[k])
    return True


# --------------------------------------------------------------------------------------------------
# export


def _pp_group_and_size() -> tuple[Any, int]:
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return (
            parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    return None, 1


def export_official_state(model_chunks: nn.Module | list[nn.Module]) -> dict[str, torch.Tensor]:
    """Full official-layout state (every rank gets every tensor): TP gathered, EP gathered, PP broadcast."""
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    natives = _native_tensors(chunks)
    by_name = {nt.name: nt for nt in natives}
    order = [nt.name for nt in natives]
    group, pp = _pp_group_and_size()
    if pp > 1:
        lists: list[Any] = [None] * pp
        dist.all_gather_object(lists, order, group=group)
        order = list(dict.fromkeys(n for lst in lists for n in lst))
        # A tensor on several stages (the embedding the MTP block shares) is sent by its first stage only, as
        # Megatron-Bridge 0.5 chooses; 0.4 refuses a tensor that more than one stage offers.
        first = {n: stage for stage in reversed(range(pp)) for n in lists[stage]}
        here = dist.get_rank(group)
        by_name = {n: nt for n, nt in by_name.items() if first[n] == here}
    unmapped = [n for n in order if lookup_native(n) is None]
    if unmapped:
        raise CheckpointMappingError(
            f"{len(unmapped)} native tensors have no row in impl.conversion.mapping and cannot be exported: "
            + ", ".join(unmapped)
        )
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in order:
            _, row, _ = lookup_native(name)
            mapping = _resolved(row, name)
            nt = by_name.get(name)
            weights = nt.tensor.detach() if nt is not None else None
            module: Any = nt.module if nt is not None else None
            if row.is_expert and _ep_size_of(mapping) == 1:
                # EP=1 gathers nothing; Megatron-Bridge < 0.5 still all_gathers (needing a process group), 0.5+ skips.
                mapping.gather_from_ep_ranks = lambda w, _module, hf_name: {str(hf_name): w}
            if nt is not None and row.is_expert:
                # Megatron-Bridge's EP gather reads num_moe_experts from the module's config.
                module = SimpleNamespace(config=SimpleNamespace(num_moe_experts=nt.n_experts), _parameters={})
            for off, tensor in mapping.megatron_to_hf(weights, module).items():
                if off in out:
                    raise CheckpointMappingError(f"export produced {off} twice (second from native {name})")
                if weights is not None and tensor.untyped_storage().data_ptr() == weights.untyped_storage().data_ptr():
                    tensor = tensor.clone()  # never hand out views of live parameters
                out[off] = tensor
    return out


# FP8 / MXFP4 (int8-packed) / integer formats: W + delta is not representable in them without re-quantizing.
_QUANTIZED_FORMATS = "float8_e4m3fn, float8_e5m2, float8_e8m0fnu, int8, uint8 (MXFP4 packing)"


def export_merged_state(
    model_chunks: nn.Module | list[nn.Module], lora: Any, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Collective: :func:`export_official_state` with each LoRA delta merged into its base weight.

    ``W' = (float32(W) + (alpha/r) * float32(B) @ float32(A)).to(dtype or W.dtype)``: the merge runs in fp32 and the
    result is cast once (``dtype`` applies to the merged weights; every other tensor keeps its dtype). A quantized
    base needs nothing special: the native weights already hold the exactly dequantized values
    (:func:`load_official_checkpoint`), so the merge is exact in the same sense. Writing the result
    back in the base's FP8 / MXFP4 format would re-quantize ``W + delta`` (lossy; Megatron-Bridge 0.6.2 re-quantizes
    before merging and crashes), so a quantized ``dtype`` is refused with :class:`QuantizationError` on every rank
    before any collective. ``lora`` is the :class:`impl.lora.wrappers.LoraHandle` (or its LoRA) that built the adapters.
    Portable V4 adapters are adapter-only (:mod:`impl.adapter.export`); this exists for users who must hand a merged model
    to a system without LoRA support.
    """
    if dtype is not None and (not dtype.is_floating_point or dtype.itemsize < 2):
        raise QuantizationError(
            f"merged export in {dtype} refused: casting W + (alpha/r)*B@A to a quantized format ({_QUANTIZED_FORMATS}) "
            "re-quantizes every merged weight and cannot be exact. Export the merged model in torch.bfloat16 or "
            "torch.float32, or export the adapter alone (impl.export_adapter) and keep the quantized base as it is."
        )
    adapter = gather_adapter_state(model_chunks, lora, writer_rank=None)
    state = export_official_state(model_chunks)
    scale = adapter.alpha / adapter.r
    suffix_a, suffix_b = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
    for name_a, a in adapter.tensors.items():
        if not name_a.endswith(suffix_a):
            continue
        stem = name_a[: -len(suffix_a)]
        # apply_lora wraps ungated attention projections only: each A has its B and one official base weight.
        _, _, (off,) = lookup_native(stem + ".weight")
        base = state[off]
        delta = adapter.tensors[stem + suffix_b].to(torch.float32) @ a.to(torch.float32)
        merged = base.to(torch.float32) + scale * delta.to(base.device)
        state[off] = merged.to(dtype or base.dtype)
    return state


register()
