"""Adapter-only portable export of a DeepSeek-V4 LoRA: fail-closed, collective, atomic.

Input is an *adapter state*: FULL (already gathered) native LoRA tensors
(``decoder.layers.N.self_attention.<leaf>.adapter.linear_in.weight`` = lora_A ``[r, in]``,
``...linear_out.weight`` = lora_B ``[out, r]``) plus the LoRA hyper-parameters. The TP/EP/PP gather is the
caller's ``adapter_phase`` callable (run on every rank; it returns the state on the writer rank), so the
exporter does not depend on how the model is built.

``publish_in_memory`` (trainer -> rollout weight sync) and ``export_adapter`` (files) share ``_build``: the file
is the in-memory result serialized.

Collective protocol (``export_adapter``): phases gather, serialize, write, fsync, validate, publish, marker,
commit. After each phase every rank posts its status (``""`` or ``"ExcType: message"``) to the default process
group's key-value store and waits for all peers' statuses with a deadline; a missing status becomes
``rank R: no response within Ts in phase P (dead or hung)``. Any failure makes every surviving rank roll back
and raise the same :class:`CollectiveExportError`. The store exchange leaves the process group usable.

On-disk protocol (writer rank, destination ``D`` in parent ``P``; one export per destination at a time):
``P/.D.dsv4-staging`` is written, fsynced and re-validated (the re-read runs in background threads over an mmap
while the fsync phase waits for the disk); publish renames ``D`` aside to ``P/.D.dsv4-old``
(or creates that directory holding ``.dsv4-absent`` when ``D`` did not exist), then renames staging to ``D``;
marker writes ``D/.complete`` (tmp + fsync + rename) naming the sha256 of every file; commit renames the old
directory to ``P/.D.dsv4-trash`` (the atomic commit point), and once every rank has answered, the trash is
deleted. A rank lost after the commit point is still reported, but the error says that the new adapter WAS
committed (a writer lost inside the commit: either the new export or the old one, never a mix).
Crash safety: while ``.D.dsv4-old`` exists the export is uncommitted and :func:`recover_export_dir` (run at
the start of every export, and by a surviving rank when the writer is reported dead) rolls back to it; the
``.complete`` marker lives inside the directory it certifies and moves with it, so a stale marker can never sit
next to a different adapter.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from impl.adapter.dialects import DIALECTS, PEFT_PREFIX, Dialect, official_base_name, parse_native
from impl.adapter.fingerprint import METADATA_KEY, verify_fingerprint
from impl.errors import ExportError, MultiLoRAUnsupportedError

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
COMPLETE_MARKER = ".complete"
PHASES = ("gather", "serialize", "write", "fsync", "validate", "publish", "marker", "commit")
_ABSENT = ".dsv4-absent"
_CHUNK = 8 << 20


class EmptyAdapterError(ExportError):
    """The adapter state holds no tensors, or a declared target has none."""


class MissingAdapterHalfError(ExportError):
    """A module has lora_A without lora_B (or the reverse)."""


class AdapterShapeError(ExportError):
    """A LoRA tensor's shape disagrees with r or with the base weight it adapts."""


class NonFiniteAdapterError(ExportError):
    """A LoRA tensor holds NaN or Inf."""


class MtpNotExportableError(ExportError):
    """MTP adapters cannot be expressed in the requested dialect."""


class CollectiveExportError(ExportError):
    """The export failed on one or more ranks; the message names each rank, its phase and cause."""


class AdapterValidationError(ExportError):
    """An exported adapter directory is inconsistent (file, tensor or field named)."""


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
class _Built:
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    metadata: dict[str, str]
    modules: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # exported name -> the native name it came from


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


def _base_shapes(
    base_fingerprint: Mapping[str, Any] | None, base_shapes: Mapping[str, Sequence[int]] | None
) -> dict[str, tuple[int, ...]] | None:
    shapes: dict[str, tuple[int, ...]] = {}
    if base_fingerprint is not None:
        shapes.update({k: tuple(v["shape"]) for k, v in base_fingerprint["tensors"].items()})
    if base_shapes is not None:
        shapes.update({k: tuple(v) for k, v in base_shapes.items()})
    return shapes if (base_fingerprint is not None or base_shapes is not None) else None


def _build(
    state: AdapterState | Mapping[str, AdapterState],
    *,
    dialect: str = "transformers",
    base_model_name_or_path: str | None = None,
    base_fingerprint: Mapping[str, Any] | None = None,
    base_shapes: Mapping[str, Sequence[int]] | None = None,
    mtp: str = "reject",
    check_finite: bool = True,
) -> _Built:
    """Validate (fail closed) and rename; shared by in-memory publication and file export. The file export passes
    ``check_finite=False``: it checks finiteness on the staged file's re-read instead (one pass, off the critical
    path, see :class:`_StagedFileCheck`)."""
    st = _single_state(state)
    if dialect not in DIALECTS:
        raise ExportError(f"unknown dialect {dialect!r}; choose one of {sorted(DIALECTS)}")
    if mtp not in ("reject", "exclude"):
        raise ExportError(f"mtp={mtp!r}: use 'reject' or 'exclude'")
    d: Dialect = DIALECTS[dialect]
    if not (isinstance(st.r, int) and st.r > 0) or not st.alpha > 0 or not 0.0 <= st.dropout < 1.0:
        raise ExportError(f"invalid LoRA hyper-parameters r={st.r} alpha={st.alpha} dropout={st.dropout}")
    if not st.tensors:
        raise EmptyAdapterError(
            "adapter state holds no tensors: the gather produced nothing (is LoRA applied, and is this the "
            "writer rank?); nothing was exported"
        )
    modules: dict[tuple, dict[str, tuple[str, torch.Tensor]]] = {}
    parsed = {}
    for name, tensor in st.tensors.items():
        p = parse_native(name)
        parsed[p.module_key] = p
        halves = modules.setdefault(p.module_key, {})
        if p.half in halves:  # only possible when one state mixes the Miles and upstream layouts
            raise ExportError(f"{name} and {halves[p.half][0]} name the same adapter tensor; use one native layout")
        halves[p.half] = (name, tensor)
    for halves in modules.values():
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
    present = {p.row.native for p in parsed.values()}
    if st.targets is not None:
        declared = list(st.targets)
        for t in declared:
            if t not in present:
                raise EmptyAdapterError(
                    f"declared target {t!r} has no tensors in the adapter state; nothing was exported"
                )
        extra = sorted(present - set(declared))
        if extra:
            raise ExportError(f"adapter state holds tensors for undeclared targets {extra}; declare them or drop them")
        if st.num_layers is not None:
            for layer in range(st.num_layers):
                for t in declared:
                    if (0, layer, t) not in modules:
                        raise EmptyAdapterError(
                            f"target {t!r} has no tensors in layer {layer} "
                            f"(decoder.layers.{layer}.self_attention.{t}.adapter.*); nothing was exported"
                        )
    shapes = _base_shapes(base_fingerprint, base_shapes)
    excluded: list[str] = []
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    module_names: list[str] = []
    for key in sorted(modules):
        p = parsed[key]
        (a_name, a), (b_name, b) = modules[key]["A"], modules[key]["B"]
        if p.layer is None and d.mtp_module is None:
            if mtp == "reject":
                raise MtpNotExportableError(
                    f"{a_name}: MTP adapters cannot be exported in dialect {d.name!r} ({d.mtp_reason}); pass "
                    "mtp='exclude' to drop them (recorded in the adapter metadata) or use dialect='official'"
                )
            excluded += [a_name, b_name]
            continue
        for n, t in ((a_name, a), (b_name, b)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise AdapterShapeError(f"{n}: expected a 2-D floating tensor, got {getattr(t, 'shape', type(t))}")
        if a.shape[0] != st.r or b.shape[1] != st.r:
            raise AdapterShapeError(
                f"{a_name} {list(a.shape)} / {b_name} {list(b.shape)}: expected lora_A [r={st.r}, in] and "
                f"lora_B [out, r={st.r}]"
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
                    f"[{out_f}, {in_f}]: expected lora_A [{st.r}, {in_f}], lora_B [{out_f}, {st.r}]"
                )
        for n, t in ((a_name, a), (b_name, b)) if check_finite else ():
            if not _all_finite(t):
                raise NonFiniteAdapterError(f"{n} holds NaN/Inf values; refusing to publish a corrupt adapter")
        module = d.module_name(p.layer, p.row)
        module_names.append(module)
        for half, n, t in (("lora_A", a_name, a), ("lora_B", b_name, b)):
            exported = f"{PEFT_PREFIX}{module}.{half}.weight"
            out[exported], sources[exported] = t.detach().contiguous(), n
    if not out:
        raise EmptyAdapterError(f"no adapter tensors remain after excluding {excluded}; nothing was exported")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
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
    metadata = {"format": "pt", "dsv4_dialect": d.name}
    if base_fingerprint is not None:
        metadata[METADATA_KEY] = json.dumps(base_fingerprint, sort_keys=True)
    if excluded:
        metadata["dsv4_excluded"] = json.dumps({"tensors": excluded, "reason": d.mtp_reason})
    return _Built(out, config, metadata, module_names, sources)


# NaN/Inf <=> every exponent bit set <=> the bits without the sign, read unsigned, >= the exponent mask
_EXPONENT_MASKS = {
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float16: (np.uint16, 0x7C00),
    torch.float32: (np.uint32, 0x7F800000),
}


def _finite_bits(raw: np.ndarray, dtype: torch.dtype) -> bool:
    """No NaN/Inf among the bytes ``raw`` of a ``dtype`` in :data:`_EXPONENT_MASKS` (whole elements)."""
    uint, mask = _EXPONENT_MASKS[dtype]
    return int(np.bitwise_and(raw.view(uint), ~uint(0) >> 1).max(initial=0)) < mask


def _all_finite(t: torch.Tensor) -> bool:
    """NaN/Inf check on the exponent bits with numpy: torch.isfinite on CPU bf16 is far slower."""
    if t.dtype not in _EXPONENT_MASKS:
        return bool(torch.isfinite(t).all())
    return _finite_bits(_raw(t), t.dtype)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def publish_in_memory(
    adapter_state: AdapterState | Mapping[str, AdapterState],
    *,
    dialect: str = "transformers",
    base_model_name_or_path: str | None = None,
    base_fingerprint: Mapping[str, Any] | None = None,
    base_shapes: Mapping[str, Sequence[int]] | None = None,
    mtp: str = "reject",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT-named adapter tensors and ``adapter_config.json`` dict, for trainer -> rollout weight sync.

    Exactly what :func:`export_adapter` writes (same validation); raises an :class:`ExportError` subclass naming
    the offending tensor on empty/partial/mis-shaped/non-finite input."""
    built = _build(
        adapter_state,
        dialect=dialect,
        base_model_name_or_path=base_model_name_or_path,
        base_fingerprint=base_fingerprint,
        base_shapes=base_shapes,
        mtp=mtp,
    )
    return built.tensors, built.config


# ----------------------------------------------------------------------------------------------- on-disk helpers


def _sidecars(out_dir: Path) -> tuple[Path, Path, Path]:
    parent, name = out_dir.parent, out_dir.name
    return parent / f".{name}.dsv4-staging", parent / f".{name}.dsv4-old", parent / f".{name}.dsv4-trash"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def recover_export_dir(out_dir: str | os.PathLike) -> str:
    """Roll back an export to ``out_dir`` that crashed before committing; returns what was done.

    Uncommitted = ``.<name>.dsv4-old`` exists: the published directory is removed and the old one restored.
    Staging and trash leftovers are deleted."""
    out_dir = Path(out_dir)
    staging, old, trash = _sidecars(out_dir)
    actions = []
    if old.exists():
        if out_dir.exists():
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(out_dir, trash)
        if (old / _ABSENT).exists():
            shutil.rmtree(old)
        else:
            os.replace(old, out_dir)
        actions.append("restored the previous destination")
    for leftover in (staging, trash):
        if leftover.exists():
            shutil.rmtree(leftover)
            actions.append(f"removed {leftover.name}")
    if actions and out_dir.parent.exists():
        _fsync_path(out_dir.parent)
    return "; ".join(actions) or "nothing to recover"


def _config_text(config: Mapping[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _expected_header(built: _Built) -> dict[str, tuple[list[int], torch.dtype]]:
    return {k: (list(v.shape), v.dtype) for k, v in built.tensors.items()}


def _check_header(path: Path, built: _Built) -> None:
    from safetensors import safe_open

    with safe_open(str(path / ADAPTER_FILE), framework="pt") as f:
        got = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        meta = f.metadata() or {}
    want = {k: (s, _st_dtype(d)) for k, (s, d) in _expected_header(built).items()}
    if got != want:
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:4]
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: tensor names/shapes/dtypes differ from the export: {bad}")
    if meta != built.metadata:
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: header metadata differs from the export")


def _st_dtype(dtype: torch.dtype) -> str:
    return {
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.float32: "F32",
        torch.float64: "F64",
    }.get(dtype, str(dtype))


# ---------------------------------------------------------------------------------------------------- collective


class _Exchange:
    """Per-phase status exchange over the default group's store, with a deadline; never poisons the group."""

    _seq = 0

    def __init__(self, timeout_s: float):
        _Exchange._seq += 1
        self.timeout_s = timeout_s
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.store = distributed_c10d._get_default_store()
        else:
            self.rank, self.world, self.store = 0, 1, None
        self.prefix = f"dsv4_export/{_Exchange._seq}/"

    def agree(self, phase: str, status: str) -> list[str]:
        """Post this rank's status for ``phase`` and return every rank's failure (same list on every rank)."""
        if self.store is None:
            return [f"rank 0: {status}"] if status else []
        try:
            self.store.set(f"{self.prefix}{phase}/{self.rank}", status or "ok")
            failures = []
            deadline = time.monotonic() + self.timeout_s
            for r in range(self.world):
                key = f"{self.prefix}{phase}/{r}"
                try:
                    self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                except Exception:  # store timeout: that rank never reported
                    failures.append(f"rank {r}: no response within {self.timeout_s:g}s in phase {phase} (dead or hung)")
                    continue
                value = self.store.get(key).decode()
                if value != "ok":
                    failures.append(f"rank {r}: {value}")
            if failures:
                self.store.set(f"{self.prefix}abort", "1")
            elif self.store.check([f"{self.prefix}abort"]):
                failures.append(f"export aborted by a peer that timed out before phase {phase}")
            return failures
        except Exception:  # the store itself is gone: the rank hosting it (rank 0 by default) died
            return [f"rank 0: no response within {self.timeout_s:g}s in phase {phase} (store host dead or hung)"]


@dataclass
class _Ctx:
    rank: int
    world: int
    writer: bool
    out_dir: Path
    adapter_phase: Callable[[], Any] | AdapterState | Mapping[str, AdapterState]
    build_kwargs: dict[str, Any]
    state: Any = None
    built: _Built | None = None
    payload: dict[str, torch.Tensor] | None = None
    payload_size: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    published: bool = False
    check: Any = None  # the _StagedFileCheck started by the write phase


def _phase_gather(ctx: _Ctx) -> None:
    if ctx.writer:
        recover_export_dir(ctx.out_dir)
    ctx.state = ctx.adapter_phase() if callable(ctx.adapter_phase) else ctx.adapter_phase
    if ctx.writer and ctx.state is None:
        raise EmptyAdapterError("the gather phase returned no adapter state on the writer rank")


def _phase_serialize(ctx: _Ctx) -> None:
    if ctx.writer:
        ctx.built = _build(ctx.state, **ctx.build_kwargs, check_finite=False)
        ctx.payload = {k: v.to("cpu") for k, v in ctx.built.tensors.items()}


def _phase_write(ctx: _Ctx) -> None:
    if ctx.writer:
        staging, _, _ = _sidecars(ctx.out_dir)
        ctx.out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        safetensors.torch.save_file(ctx.payload, str(staging / ADAPTER_FILE), metadata=ctx.built.metadata)
        with open(staging / CONFIG_FILE, "w") as f:
            f.write(_config_text(ctx.built.config))
        # The re-read check needs only the page cache, so it runs while the fsync phase waits for the disk.
        ctx.check = _StagedFileCheck(staging / ADAPTER_FILE, ctx.payload, ctx.built.sources)


def _phase_fsync(ctx: _Ctx) -> None:
    if ctx.writer:
        staging, _, _ = _sidecars(ctx.out_dir)
        for name in (ADAPTER_FILE, CONFIG_FILE):
            _fsync_path(staging / name)
        _fsync_path(staging)
        _fsync_path(ctx.out_dir.parent)


def _phase_validate(ctx: _Ctx) -> None:
    """Re-open the staged files: every tensor's bytes on disk identical to the validated (finite, shape-checked)
    in-memory tensor, the header as built (read back with safetensors), config as built; hashes for the marker."""
    if not ctx.writer:
        return
    staging, _, _ = _sidecars(ctx.out_dir)
    digest = ctx.check.result()
    _check_header(staging, ctx.built)
    ctx.payload_size = (staging / ADAPTER_FILE).stat().st_size
    config_text = (staging / CONFIG_FILE).read_text()
    if json.loads(config_text) != json.loads(_config_text(ctx.built.config)):
        raise AdapterValidationError(f"{staging / CONFIG_FILE} differs from the exported config")
    ctx.hashes = {ADAPTER_FILE: digest, CONFIG_FILE: hashlib.sha256(config_text.encode()).hexdigest()}
    ctx.payload = None  # release the serialized copy before publishing


class _StagedFileCheck:
    """Background re-read of a written safetensors file through one read-only mmap: thread 1 compares every
    tensor's bytes with the in-memory tensor it must hold and checks the (equal) values for NaN/Inf, chunk by
    chunk while they are in cache; thread 2 computes the file's sha256 (both release the GIL). :meth:`result`
    joins them and returns the digest or raises :class:`AdapterValidationError` / :class:`NonFiniteAdapterError`
    (naming the native tensor, from ``sources``)."""

    def __init__(self, path: Path, payload: Mapping[str, torch.Tensor], sources: Mapping[str, str]):
        self.path, self.payload, self.sources = path, payload, sources
        self.errors: list[str] = []
        self.nonfinite: list[str] = []
        self.digest = ""
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.threads = [
            threading.Thread(target=self._guarded, args=(fn,), daemon=True) for fn in (self._compare, self._hash)
        ]
        for t in self.threads:
            t.start()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # reported by result(), on the phase's own thread
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _hash(self) -> None:
        self.digest = hashlib.sha256(self.mm).hexdigest()

    def _compare(self) -> None:
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        (n,) = np.frombuffer(self.mm, dtype="<u8", count=1)
        header = json.loads(bytes(buf[8 : 8 + int(n)]))
        base = 8 + int(n)
        for name, want in self.payload.items():
            start, end = header.get(name, {}).get("data_offsets", (0, -1))
            raw = _raw(want)
            if end - start != raw.size:
                self.errors.append(f"{self.path}: tensor {name} has {end - start} bytes on disk, {raw.size} exported")
                continue
            by_bits = want.dtype in _EXPONENT_MASKS
            finite = by_bits or _all_finite(want)
            for i in range(0, raw.size, _CHUNK):  # chunked: no full-size temporary
                chunk = raw[i : i + _CHUNK]
                if not np.array_equal(buf[base + start + i : base + start + i + chunk.size], chunk):
                    self.errors.append(f"{self.path}: tensor {name} on disk differs from the export")
                    break
                if by_bits and finite:  # the bytes on disk are these: check them while cached
                    finite = _finite_bits(chunk, want.dtype)
            if not finite:
                self.nonfinite.append(f"{self.sources.get(name, name)} (exported as {name})")
        del buf

    def result(self) -> str:
        self.join()
        if self.errors:
            raise AdapterValidationError("; ".join(self.errors))
        if self.nonfinite:
            raise NonFiniteAdapterError(
                f"{', '.join(self.nonfinite)} hold(s) NaN/Inf values; refusing to publish a corrupt adapter"
            )
        return self.digest

    def join(self) -> None:
        for t in self.threads:
            t.join()
        try:
            self.mm.close()
        except BufferError:  # a view survived in a traceback; the mapping goes with it
            pass


def _phase_publish(ctx: _Ctx) -> None:
    if not ctx.writer:
        return
    staging, old, _ = _sidecars(ctx.out_dir)
    if ctx.out_dir.exists():
        os.replace(ctx.out_dir, old)
    else:
        old.mkdir()
        (old / _ABSENT).touch()
    _fsync_path(ctx.out_dir.parent)
    ctx.published = True
    os.replace(staging, ctx.out_dir)
    _fsync_path(ctx.out_dir.parent)
    # Cheap post-rename check: the published files are the validated ones (size + header).
    size = (ctx.out_dir / ADAPTER_FILE).stat().st_size
    if size != ctx.payload_size:
        raise AdapterValidationError(
            f"{ctx.out_dir / ADAPTER_FILE}: {size} bytes published, {ctx.payload_size} validated"
        )
    _check_header(ctx.out_dir, ctx.built)


def _phase_marker(ctx: _Ctx) -> None:
    if not ctx.writer:
        return
    marker = {
        "format": "dsv4-lora-adapter",
        "version": 1,
        "dialect": ctx.built.metadata["dsv4_dialect"],
        "files": ctx.hashes,
    }
    tmp = ctx.out_dir / (COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ctx.out_dir / COMPLETE_MARKER)
    _fsync_path(ctx.out_dir)


def _phase_commit(ctx: _Ctx) -> None:
    if not ctx.writer:
        return
    _, old, trash = _sidecars(ctx.out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(old, trash)  # the commit point: without .dsv4-old nothing will be rolled back


def _after_commit(ctx: _Ctx) -> None:
    """Writer, past the commit point: make the rename durable and drop the old export. Best effort: a failure
    here cannot un-commit (a crash before the directory sync at worst brings ``.dsv4-old`` back, which the next
    export's recovery rolls back to), so it is a warning, not an export failure."""
    if not ctx.writer:
        return
    _, _, trash = _sidecars(ctx.out_dir)
    try:
        _fsync_path(ctx.out_dir.parent)
        shutil.rmtree(trash)
    except OSError as exc:
        warnings.warn(
            f"adapter export to {ctx.out_dir} is committed, but cleaning up after the commit failed: "
            f"{type(exc).__name__}: {exc}; the next export to it retries",
            RuntimeWarning,
            stacklevel=3,
        )


_PHASE_FNS = {
    "gather": "_phase_gather",
    "serialize": "_phase_serialize",
    "write": "_phase_write",
    "fsync": "_phase_fsync",
    "validate": "_phase_validate",
    "publish": "_phase_publish",
    "marker": "_phase_marker",
    "commit": "_phase_commit",
}


def export_adapter(
    adapter_phase: Callable[[], AdapterState | Mapping[str, AdapterState] | None]
    | AdapterState
    | Mapping[str, AdapterState],
    out_dir: str | os.PathLike,
    *,
    dialect: str = "transformers",
    base_model_name_or_path: str | None = None,
    base_fingerprint: Mapping[str, Any] | None = None,
    base_shapes: Mapping[str, Sequence[int]] | None = None,
    mtp: str = "reject",
    writer_rank: int = 0,
    timeout_s: float = 300.0,
) -> Path:
    """Collective adapter-only export to ``out_dir`` (a PEFT directory + ``.complete``); returns ``out_dir``.

    Call on EVERY rank (``torch.distributed`` if initialised, else world 1). ``adapter_phase`` is the gather:
    a callable run on every rank that returns the full adapter state on ``writer_rank`` (other ranks may return
    None), or the state itself. On any failure on any rank, every surviving rank raises the same
    :class:`CollectiveExportError` naming each failing rank, and ``out_dir`` is left exactly as it was.
    ``timeout_s`` bounds each phase's wait for peers; it must exceed the slowest phase."""
    import sys

    module = sys.modules[__name__]
    ex = _Exchange(timeout_s)
    ctx = _Ctx(
        rank=ex.rank,
        world=ex.world,
        writer=ex.rank == writer_rank,
        out_dir=Path(os.path.abspath(out_dir)),
        adapter_phase=adapter_phase,
        build_kwargs={
            "dialect": dialect,
            "base_model_name_or_path": base_model_name_or_path,
            "base_fingerprint": base_fingerprint,
            "base_shapes": base_shapes,
            "mtp": mtp,
        },
    )
    if not 0 <= writer_rank < ex.world:
        raise ExportError(f"writer_rank={writer_rank} is outside the world of {ex.world} ranks")
    for phase in PHASES:
        cause: BaseException | None = None
        try:
            getattr(module, _PHASE_FNS[phase])(ctx)
            status = ""
        except Exception as exc:  # collected across ranks below, then re-raised identically everywhere
            cause = exc
            status = f"{type(exc).__name__}: {exc}"
        failures = ex.agree(phase, status)
        if not failures:
            continue
        head = f"adapter export to {ctx.out_dir} failed in phase {phase}: " + "; ".join(failures) + ". "
        # Only the writer acts in the commit phase, so its own status says whether the commit point was passed.
        writer_named = any(f.startswith(f"rank {writer_rank}: ") for f in failures)
        if phase == "commit" and not writer_named:  # it committed; a peer lost after that cannot un-commit
            _after_commit(ctx)
            raise CollectiveExportError(
                head + f"The new adapter WAS committed (rank {writer_rank} passed the commit point and "
                f"{ctx.out_dir}/{COMPLETE_MARKER} certifies it); the rank(s) above were lost after that. Find out "
                "why; the export itself need not be re-run."
            ) from cause
        _roll_back(ctx, failures, writer_rank)
        if phase == "commit" and _writer_lost(failures, writer_rank):  # before or after its rename: unknown
            raise CollectiveExportError(
                head + f"The writer (rank {writer_rank}) stopped inside the commit, so the destination holds either "
                "the complete new adapter or the earlier export, never a mix; check its .complete "
                "(impl.validate_adapter_dir) before using it."
            ) from cause
        raise CollectiveExportError(
            head + "Nothing was published and the destination is unchanged; fix the cause named above and re-run."
        ) from cause
    _after_commit(ctx)
    return ctx.out_dir


def _writer_lost(failures: list[str], writer_rank: int) -> bool:
    return any(f.startswith(f"rank {writer_rank}: no response") for f in failures)


def _roll_back(ctx: _Ctx, failures: list[str], writer_rank: int) -> None:
    if ctx.writer or (
        _writer_lost(failures, writer_rank) and ctx.rank == min(r for r in range(ctx.world) if r != writer_rank)
    ):
        try:
            recover_export_dir(ctx.out_dir)
        except OSError:  # best effort; the next export's recovery retries
            pass
    if ctx.check is not None:
        ctx.check.join()
    ctx.payload = None


# ------------------------------------------------------------------------------------------------- validation


def validate_adapter_dir(
    adapter_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    base_config: Mapping[str, Any] | None = None,
    require_complete: bool = True,
) -> dict[str, Any]:
    """Fully check an exported adapter (files, marker hashes, names, halves, shapes vs r, finiteness,
    target_modules vs tensors, fingerprint vs ``base`` when given). Returns ``{"config", "modules", "marker"}``;
    raises :class:`AdapterValidationError` naming the offending file/tensor."""
    from safetensors import safe_open

    path = Path(adapter_dir)
    for name in (ADAPTER_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise AdapterValidationError(f"{path}: missing {name}")
    marker = None
    if (path / COMPLETE_MARKER).is_file():
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        for name, digest in marker["files"].items():
            if _file_sha256(path / name) != digest:
                raise AdapterValidationError(f"{path / name}: sha256 differs from what {COMPLETE_MARKER} certifies")
    elif require_complete:
        raise AdapterValidationError(f"{path}: no {COMPLETE_MARKER} marker; the export did not complete")
    config = json.loads((path / CONFIG_FILE).read_text())
    for key, want in (("peft_type", "LORA"), ("bias", "none"), ("task_type", "CAUSAL_LM")):
        if config.get(key) != want:
            raise AdapterValidationError(f"{path / CONFIG_FILE}: {key}={config.get(key)!r}, expected {want!r}")
    r = config["r"]
    with safe_open(str(path / ADAPTER_FILE), framework="pt") as f:
        meta = f.metadata() or {}
        d = DIALECTS.get(meta.get("dsv4_dialect", ""))
        if d is None:
            raise AdapterValidationError(f"{path / ADAPTER_FILE}: unknown dsv4_dialect {meta.get('dsv4_dialect')!r}")
        halves: dict[str, set[str]] = {}
        for k in f.keys():
            if not k.startswith(PEFT_PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight")):
                raise AdapterValidationError(f"{path / ADAPTER_FILE}: unexpected tensor {k}")
            module, half = k[len(PEFT_PREFIX) :].rsplit(".", 2)[0], k.rsplit(".", 2)[1]
            t = f.get_tensor(k)
            if (half == "lora_A" and t.shape[0] != r) or (half == "lora_B" and t.shape[1] != r) or t.dim() != 2:
                raise AdapterValidationError(f"{k}: shape {list(t.shape)} disagrees with r={r}")
            if not _all_finite(t):
                raise AdapterValidationError(f"{k}: holds NaN/Inf")
            halves.setdefault(module, set()).add(half)
    for module, hs in halves.items():
        if hs != {"lora_A", "lora_B"}:
            raise AdapterValidationError(f"{module}: only {sorted(hs)} present")
    if not halves:
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: no adapter tensors")
    want_targets = d.target_modules(list(halves))
    if config.get("target_modules") != want_targets:
        raise AdapterValidationError(
            f"{path / CONFIG_FILE}: target_modules {config.get('target_modules')!r} does not select exactly the "
            f"{len(halves)} exported modules"
        )
    if base is not None:
        verify_fingerprint(path, base, config=base_config)
    return {"config": config, "modules": sorted(halves), "marker": marker}


__all__ = [
    "ADAPTER_FILE",
    "COMPLETE_MARKER",
    "CONFIG_FILE",
    "PHASES",
    "AdapterShapeError",
    "AdapterState",
    "AdapterValidationError",
    "CollectiveExportError",
    "EmptyAdapterError",
    "MissingAdapterHalfError",
    "MtpNotExportableError",
    "NonFiniteAdapterError",
    "export_adapter",
    "publish_in_memory",
    "recover_export_dir",
    "validate_adapter_dir",
]
