"""From an adapter state (full native LoRA tensors + hyper-parameters) to the PEFT tensors, config and metadata.

Input: ``decoder.layers.N.self_attention.<leaf>.adapter.linear_in.weight`` = lora_A ``[r, in]`` and
``...linear_out.weight`` = lora_B ``[out, r]``, already gathered. :func:`build_adapter` checks the state (fail
closed, naming the tensor) and renames it into a dialect; :func:`publish_in_memory` (trainer -> rollout weight
sync) returns its result and the file export writes it, so the file is the in-memory result serialized."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from impl.adapter.dialects import DIALECTS, PEFT_PREFIX, Dialect, NativeAdapterName, official_base_name, parse_native
from impl.adapter.fingerprint import METADATA_KEY
from impl.adapter.raw import finite_bits as raw_finite_bits
from impl.errors import (
    AdapterShapeError,
    EmptyAdapterError,
    ExportError,
    MissingAdapterHalfError,
    MtpNotExportableError,
    MultiLoRAUnsupportedError,
    NonFiniteAdapterError,
)


@dataclass
class AdapterState:
    """Full native LoRA tensors + hyper-parameters of ONE adapter."""

    tensors: Mapping[str, torch.Tensor]
    r: int
    alpha: float
    dropout: float = 0.0
    targets: Sequence[str] | None = None  # declared native leaves; each must have tensors
    num_layers: int | None = None  # when given, every declared target must be present in every layer


@dataclass
class BuiltAdapter:
    """What is published: PEFT-named tensors, ``adapter_config.json`` and the safetensors header metadata."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    metadata: dict[str, str]
    modules: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # exported name -> the native name it came from


@dataclass(frozen=True)
class BuildOptions:
    """How a state is published (the keyword arguments of :func:`publish_in_memory` and the file export)."""

    dialect: str = "transformers"
    base_model_name_or_path: str | None = None
    base_fingerprint: Mapping[str, Any] | None = None
    # a base directory: the writer fingerprints the base weights of the modules it exports (inside the export,
    # so a failure there is every rank's error, like any other phase's)
    fingerprint_base: str | os.PathLike | None = None
    base_shapes: Mapping[str, Sequence[int]] | None = None
    mtp: str = "reject"  # "reject" or "exclude" MTP adapters a dialect cannot express
    consumer: str | None = None  # a serving engine whose rules (impl.adapter.consumers) every target must pass
    consumer_version: str | None = None  # default: the one version impl holds rules for
    allow_unapplied: bool = False  # export anyway; the targets it would not apply go into metadata dsv4_consumer


#: safetensors metadata key of an export for a consumer: JSON of impl.adapter.consumers.ConsumerVerdict.record().
#: Not a field of adapter_config.json: PEFT, vLLM and SGLang parse that file into their own schemas and drop
#: unknown fields (PEFT warning on each load), while the header travels with the weights, untouched, under the
#: staged-header check and the marker's hash.
CONSUMER_METADATA_KEY = "dsv4_consumer"

#: One adapted module: its parsed name and (native name, tensor) for each half "A"/"B".
_Module = tuple[NativeAdapterName, dict[str, tuple[str, torch.Tensor]]]


def _single_state(state: AdapterState | Mapping[str, AdapterState]) -> AdapterState:
    if isinstance(state, AdapterState):
        return state
    if isinstance(state, Mapping) and state and all(isinstance(v, AdapterState) for v in state.values()):
        if len(state) > 1:
            raise MultiLoRAUnsupportedError(
                f"{len(state)} adapters given ({sorted(state)}): multi-LoRA export is not supported for DeepSeek-V4; "
                "export one adapter per directory"
            )
        return next(iter(state.values()))
    raise ExportError(f"expected an AdapterState (or a one-entry mapping of them), got {type(state).__name__}")


def _check_options(st: AdapterState, opts: BuildOptions) -> Dialect:
    if opts.dialect not in DIALECTS:
        raise ExportError(f"unknown dialect {opts.dialect!r}; choose one of {sorted(DIALECTS)}")
    if opts.mtp not in ("reject", "exclude"):
        raise ExportError(f"mtp={opts.mtp!r}: use 'reject' or 'exclude'")
    if not (isinstance(st.r, int) and st.r > 0) or not st.alpha > 0 or not 0.0 <= st.dropout < 1.0:
        raise ExportError(f"invalid LoRA hyper-parameters r={st.r} alpha={st.alpha} dropout={st.dropout}")
    if not st.tensors:
        raise EmptyAdapterError(
            "adapter state holds no tensors: the gather produced nothing (is LoRA applied, and is this the "
            "writer rank?); nothing was exported"
        )
    return DIALECTS[opts.dialect]


def _pair_modules(tensors: Mapping[str, torch.Tensor]) -> dict[tuple, _Module]:
    """Group the tensors by adapted module; every module must have both halves."""
    modules: dict[tuple, _Module] = {}
    for name, tensor in tensors.items():
        p = parse_native(name)
        halves = modules.setdefault(p.module_key, (p, {}))[1]
        if p.half in halves:  # only possible when one state mixes the Miles and upstream layouts
            raise ExportError(f"{name} and {halves[p.half][0]} name the same adapter tensor; use one native layout")
        halves[p.half] = (name, tensor)
    for _, halves in modules.values():
        if set(halves) != {"A", "B"}:
            have_half, (have_name, _) = next(iter(halves.items()))
            want = (
                have_name.replace("linear_in", "linear_out")
                if have_half == "A"
                else have_name.replace("linear_out", "linear_in")
            )
            raise MissingAdapterHalfError(
                f"{have_name} has no partner {want}: the gather lost half of the adapter; nothing was exported"
            )
    return modules


def _check_declared(st: AdapterState, modules: Mapping[tuple, _Module]) -> None:
    """Declared targets have tensors (in every layer when ``num_layers`` is given) and nothing else does."""
    if st.targets is None:
        return
    present = {p.row.native for p, _ in modules.values()}
    declared = list(st.targets)
    for t in declared:
        if t not in present:
            raise EmptyAdapterError(f"declared target {t!r} has no tensors in the adapter state; nothing was exported")
    extra = sorted(present - set(declared))
    if extra:
        raise ExportError(f"adapter state holds tensors for undeclared targets {extra}; declare them or drop them")
    for layer in range(st.num_layers or 0):
        for t in declared:
            if (0, layer, t) not in modules:
                raise EmptyAdapterError(
                    f"target {t!r} has no tensors in layer {layer} "
                    f"(decoder.layers.{layer}.self_attention.{t}.adapter.*); nothing was exported"
                )


def with_base_fingerprint(state: AdapterState | Mapping[str, AdapterState], opts: BuildOptions) -> BuildOptions:
    """``opts`` with ``base_fingerprint`` of ``opts.fingerprint_base``: the base weights of every module of
    ``state`` the dialect can express (MTP ones only where it has an MTP module)."""
    if opts.fingerprint_base is None:
        return opts
    if opts.base_fingerprint is not None:
        raise ExportError("pass base_fingerprint or fingerprint_base, not both")
    import impl  # the public function: what a caller (or a fault injected for a test) sees as base_fingerprint

    d = _check_options(_single_state(state), opts)
    parsed = (parse_native(n) for n in _single_state(state).tensors)
    names = [official_base_name(p.layer, p.row) for p in parsed if p.layer is not None or d.mtp_module is not None]
    fingerprint = impl.base_fingerprint(opts.fingerprint_base, sorted(set(names)))
    return replace(opts, base_fingerprint=fingerprint, fingerprint_base=None)


def _base_shapes(opts: BuildOptions) -> dict[str, tuple[int, ...]] | None:
    if opts.base_fingerprint is None and opts.base_shapes is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    if opts.base_fingerprint is not None:
        shapes.update({k: tuple(v["shape"]) for k, v in opts.base_fingerprint["tensors"].items()})
    if opts.base_shapes is not None:
        shapes.update({k: tuple(v) for k, v in opts.base_shapes.items()})
    return shapes


def _check_pair(module: _Module, r: int, shapes: Mapping[str, tuple[int, ...]] | None, check_finite: bool) -> None:
    p, halves = module
    (a_name, a), (b_name, b) = halves["A"], halves["B"]
    for n, t in ((a_name, a), (b_name, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise AdapterShapeError(f"{n}: expected a 2-D floating tensor, got {getattr(t, 'shape', type(t))}")
    if a.shape[0] != r or b.shape[1] != r:
        raise AdapterShapeError(
            f"{a_name} {list(a.shape)} / {b_name} {list(b.shape)}: expected lora_A [r={r}, in] and lora_B [out, r={r}]"
        )
    if a.dtype != b.dtype:
        raise AdapterShapeError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")
    if shapes is not None:
        base = official_base_name(p.layer, p.row)
        if base not in shapes:
            raise AdapterShapeError(f"{a_name}: the base has no weight {base} to adapt")
        out_f, in_f = shapes[base]
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise AdapterShapeError(
                f"{a_name} {list(a.shape)} / {b_name} {list(b.shape)} disagree with base {base} "
                f"[{out_f}, {in_f}]: expected lora_A [{r}, {in_f}], lora_B [{out_f}, {r}]"
            )
    for n, t in ((a_name, a), (b_name, b)) if check_finite else ():
        if not all_finite(t):
            raise NonFiniteAdapterError(f"{n} holds NaN/Inf values; refusing to publish a corrupt adapter")


def _config(st: AdapterState, opts: BuildOptions, d: Dialect, module_names: list[str]) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": opts.base_model_name_or_path,
        "r": st.r,
        "lora_alpha": st.alpha,
        "lora_dropout": st.dropout,
        "bias": "none",
        "target_modules": d.target_modules(module_names),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def build_adapter(
    state: AdapterState | Mapping[str, AdapterState], opts: BuildOptions, *, check_finite: bool = True
) -> BuiltAdapter:
    """Validate (fail closed) and rename; shared by in-memory publication and file export. The file export passes
    ``check_finite=False``: it checks finiteness on the staged file's re-read instead (one pass, off the critical
    path)."""
    st = _single_state(state)
    d = _check_options(st, opts)
    modules = _pair_modules(st.tensors)
    _check_declared(st, modules)
    shapes = _base_shapes(opts)
    built = BuiltAdapter({}, {}, {"format": "pt", "dsv4_dialect": d.name})
    excluded: list[str] = []
    for key in sorted(modules):
        p, halves = modules[key]
        if p.layer is None and d.mtp_module is None:
            if opts.mtp == "reject":
                raise MtpNotExportableError(
                    f"{halves['A'][0]}: MTP adapters cannot be exported in dialect {d.name!r} ({d.mtp_reason}); "
                    "pass mtp='exclude' to drop them (recorded in the adapter metadata) or use dialect='official'"
                )
            excluded += [halves["A"][0], halves["B"][0]]
            continue
        _check_pair(modules[key], st.r, shapes, check_finite)
        module = d.module_name(p.layer, p.row)
        built.modules.append(module)
        for half, (native, t) in (("lora_A", halves["A"]), ("lora_B", halves["B"])):
            exported = f"{PEFT_PREFIX}{module}.{half}.weight"
            built.tensors[exported], built.sources[exported] = t.detach().contiguous(), native
    if not built.tensors:
        raise EmptyAdapterError(f"no adapter tensors remain after excluding {excluded}; nothing was exported")
    built.config = _config(st, opts, d, built.modules)
    if opts.base_fingerprint is not None:
        built.metadata[METADATA_KEY] = json.dumps(opts.base_fingerprint, sort_keys=True)
    if excluded:
        built.metadata["dsv4_excluded"] = json.dumps({"tensors": excluded, "reason": d.mtp_reason})
    if opts.consumer is not None:
        built.metadata[CONSUMER_METADATA_KEY] = _consumer_record(built.modules, opts, d)
    return built


def _consumer_record(module_names: list[str], opts: BuildOptions, d: Dialect) -> str:
    """Fail closed (:class:`impl.errors.ConsumerSupportError`) when the consumer would not apply an exported
    target, unless the caller opted in; the metadata value recording what it would not apply."""
    from impl.adapter.consumers import MTP, consumer_verdict, require_applied

    hits = [d.parse_module(m) for m in module_names]
    targets = {MTP if layer is None else row.official for layer, row in hits}
    verdict = consumer_verdict(opts.consumer, d.name, targets, opts.consumer_version)
    if not opts.allow_unapplied:
        require_applied(verdict)
    return json.dumps(verdict.record(), sort_keys=True)


def publish_in_memory(
    adapter_state: AdapterState | Mapping[str, AdapterState], **options: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT-named adapter tensors and ``adapter_config.json`` dict, for trainer -> rollout weight sync.

    Exactly what :func:`impl.adapter.export.export_adapter` writes (same validation); raises an
    :class:`ExportError` subclass naming the offending tensor on empty/partial/mis-shaped/non-finite input, and
    a :class:`impl.errors.ConsumerSupportError` when ``consumer`` would not apply a target (``allow_unapplied``
    exports anyway and records them in ``dsv4_consumer``). ``options``: the fields of :class:`BuildOptions`."""
    opts = with_base_fingerprint(adapter_state, BuildOptions(**options))
    built = build_adapter(adapter_state, opts)
    return built.tensors, built.config


# ------------------------------------------------------------------------------------------------- finiteness

#: Per torch dtype: its safetensors code in :data:`impl.adapter.raw.EXPONENT_BITS` (the one table of exponent masks).
EXPONENT_MASKS: dict[torch.dtype, str] = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def finite_bits(raw: np.ndarray, dtype: torch.dtype) -> bool:
    """No NaN/Inf among the bytes ``raw`` of a ``dtype`` in :data:`EXPONENT_MASKS` (whole elements)."""
    return raw_finite_bits(raw, EXPONENT_MASKS[dtype])


def all_finite(t: torch.Tensor) -> bool:
    """NaN/Inf check on the exponent bits with numpy: torch.isfinite on CPU bf16 is far slower."""
    if t.dtype not in EXPONENT_MASKS:
        return bool(torch.isfinite(t).all())
    return finite_bits(raw_bytes(t), t.dtype)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (no copy for a contiguous CPU tensor)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


__all__ = [
    "AdapterState",
    "publish_in_memory",
]
