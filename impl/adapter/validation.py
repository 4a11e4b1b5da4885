"""The checks of an exported adapter directory: ONE list, two reporters.

:data:`ADAPTER_CHECKS` is the list; each check is a named function over an :class:`AdapterDir` (the directory
read once: config, tensors, metadata, marker) that yields its problems. :func:`validate_adapter_dir` raises at
the first problem (the exporter's and the library's view); :func:`list_problems` runs every check and lists
them all (``dsv4-lora verify-adapter``).

| check | problem when |
|---|---|
| ``files`` | ``adapter_config.json`` / ``adapter_model.safetensors`` missing or unreadable, or pickle weights present |
| ``marker`` | ``.complete`` missing (when required), or it certifies other bytes than the files present (stale) |
| ``config`` | not LoRA, ``r`` / ``lora_alpha`` invalid, or fields V4 adapters never carry |
| ``names`` | a tensor is not a PEFT LoRA tensor, the dialect is unknown, or (with a base) a module resolves to no base weight or wraps something other than the main attention projections |
| ``halves`` | a module has only ``lora_A`` or only ``lora_B`` |
| ``shapes`` | ``lora_A [r, in]`` / ``lora_B [out, r]`` disagree with ``r`` (and with the base weight ``[out, in]``) |
| ``finite`` | a tensor is not float32/bf16/fp16/fp64, or holds NaN or Inf |
| ``selection`` | ``target_modules`` does not select exactly the exported modules |
| ``fingerprint`` | (with a base) the adapter was trained against another base, or records none |
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import torch

from impl.adapter.build import all_finite
from impl.adapter.dialects import DIALECTS, PEFT_PREFIX, Dialect
from impl.adapter.files import ADAPTER_FILE, COMPLETE_MARKER, CONFIG_FILE, file_sha256
from impl.adapter.fingerprint import FingerprintMismatchError, read_adapter_fingerprint, verify_fingerprint
from impl.errors import ExportError
from impl.lora.vocabulary import TARGET_TABLE


class AdapterValidationError(ExportError):
    """An exported adapter directory is inconsistent (file, tensor or field named)."""


#: what PEFT loads a LoRA weight as (FP8 / integer tensors are not adapters)
LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LORA_DTYPE_NAMES = ", ".join(str(d).removeprefix("torch.") for d in LORA_DTYPES)
_TENSOR_RE = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight")
_MAIN_RE = re.compile(r"(?:layers\.[0-9]+|mtp\.[0-9]+)\.attn\.([a-z_0-9]+)\.weight")


@dataclass(frozen=True)
class BaseNames:
    """The base as the name, shape and selection checks see it (given by the caller, e.g. from the base's headers).

    ``shapes``: official weight name -> shape; ``official_of``: PEFT module path -> the official weight it adapts
    (None: none); ``selectable``: dialect -> {module path: official weight} for every base module PEFT could wrap."""

    shapes: Mapping[str, Sequence[int]]
    official_of: Callable[[str], str | None]
    selectable: Callable[[str], Mapping[str, str]]


@dataclass
class AdapterDir:
    """One adapter directory as the checks read it (each file read at most once, on first use)."""

    path: Path
    require_complete: bool = True
    base_names: BaseNames | None = None  # name/shape/selection checks against a base
    fingerprint_base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None  # fingerprint check
    base_config: Mapping[str, Any] | None = None
    read_errors: list[str] = field(default_factory=list)

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def tensor_file(self) -> Path:
        return self.path / ADAPTER_FILE

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_file.read_text())

    @cached_property
    def _safetensors(self) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        from safetensors import safe_open

        with safe_open(str(self.tensor_file), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}

    @property
    def metadata(self) -> dict[str, str]:
        return self._safetensors[0]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self._safetensors[1]

    @cached_property
    def modules(self) -> dict[str, dict[str, torch.Tensor]]:
        """PEFT module path -> {"lora_A": tensor, "lora_B": tensor} (the halves present)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in self.tensors.items():
            m = _TENSOR_RE.fullmatch(key)
            if m is not None:
                out.setdefault(m[1], {})[m[2]] = t
        return out

    @property
    def dialect(self) -> Dialect | None:
        return DIALECTS.get(self.metadata.get("dsv4_dialect", ""))

    @cached_property
    def marker(self) -> dict[str, Any] | None:
        file = self.path / COMPLETE_MARKER
        return json.loads(file.read_text()) if file.is_file() else None


def _files(a: AdapterDir) -> Iterator[str]:
    missing = [f for f in (a.config_file, a.tensor_file) if not f.is_file()]
    yield from (f"{a.path}: missing {f.name}" for f in missing)
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in a.path.glob(pattern))
    yield from (f"{a.path / p}: pickle weights are never accepted" for p in pickles)
    if missing:
        return
    for file, read in ((a.config_file, lambda: a.config), (a.tensor_file, lambda: a.tensors)):
        try:
            read()
        except Exception as exc:  # a corrupt file is a finding, not a traceback
            yield f"{file}: unreadable ({type(exc).__name__}: {exc})"
            continue
        if file == a.config_file and not isinstance(a.config, dict):
            yield f"{file}: a JSON {type(a.config).__name__}, expected an object"


def _marker(a: AdapterDir) -> Iterator[str]:
    file = a.path / COMPLETE_MARKER
    try:
        marker = a.marker
        if marker is None:
            if a.require_complete:
                yield f"{file}: missing; the export never completed (or was not made by dsv4-lora)"
            return
        files = dict(marker["files"])
    except (ValueError, KeyError, TypeError) as exc:
        yield f"{file}: unreadable ({type(exc).__name__}: {exc})"
        return
    for name, digest in files.items():
        if not (a.path / name).is_file() or file_sha256(a.path / name) != digest:
            yield f"{file}: stale - certifies different bytes for {name} ({a.path / name})"
    yield from (f"{file}: does not certify {n}" for n in (CONFIG_FILE, ADAPTER_FILE) if n not in files)


def _config(a: AdapterDir) -> Iterator[str]:
    cfg, file = a.config, a.config_file
    for key, want in (("peft_type", "LORA"), ("bias", "none"), ("task_type", "CAUSAL_LM")):
        if cfg.get(key) != want:
            yield f"{file}: {key}={cfg.get(key)!r}, expected {want!r}"
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        yield f"{file}: r={r!r} must be a positive integer"
    if not isinstance(alpha, int | float) or alpha <= 0:
        yield f"{file}: lora_alpha={alpha!r} must be positive"
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        yield f"{file}: rank_pattern/alpha_pattern are not produced for V4 adapters"
    if not _valid_target_modules(cfg.get("target_modules")):
        yield f"{file}: target_modules={cfg.get('target_modules')!r} is neither a regular expression nor a list of names"


def _valid_target_modules(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, str) for v in value)
    if not isinstance(value, str):
        return False
    try:
        re.compile(value)
    except re.error:
        return False
    return True


def _names(a: AdapterDir) -> Iterator[str]:
    for key in a.tensors:
        if _TENSOR_RE.fullmatch(key) is None:
            yield f"{key}: not a PEFT LoRA tensor name (base_model.model.<module>.lora_A|B.weight)"
    if not a.modules:
        yield f"{a.tensor_file}: no adapter tensors"
    if a.dialect is None:
        yield f"{a.tensor_file}: unknown dsv4_dialect {a.metadata.get('dsv4_dialect')!r}"
    if a.base_names is None:
        return
    main = sorted({row.official for row in TARGET_TABLE.main})
    for module in a.modules:
        official = a.base_names.official_of(module)
        if official is None or official not in a.base_names.shapes:
            yield f"{module}: resolves to no base tensor ({official or 'unknown name'})"
            continue
        m = _MAIN_RE.fullmatch(official)
        if m is None or m[1] not in main:
            yield (
                f"{module}: wraps {official}, not one of the main attention projections {main} "
                "(indexer/compressor adapters are not portable)"
            )


def _halves(a: AdapterDir) -> Iterator[str]:
    for module, halves in a.modules.items():
        if set(halves) != {"lora_A", "lora_B"}:
            yield f"{module}: only {sorted(halves)} present"


def _shapes(a: AdapterDir) -> Iterator[str]:
    r = a.config.get("r")
    for module, halves in a.modules.items():
        official = a.base_names.official_of(module) if a.base_names is not None else None
        out_in = a.base_names.shapes.get(official) if a.base_names is not None and official else None
        for half, t in sorted(halves.items()):
            want = [r, None] if half == "lora_A" else [None, r]
            if out_in is not None:
                want = [r, out_in[1]] if half == "lora_A" else [out_in[0], r]
            if t.dim() != 2 or any(w is not None and w != s for w, s in zip(want, t.shape, strict=True)):
                where = f" for {official} {list(out_in)}" if out_in is not None else ""
                yield f"{module}.{half}: shape {list(t.shape)}, expected {_dims(half, want)}{where} (r={r})"


def _dims(half: str, want: list[Any]) -> str:
    names = ("r", "in") if half == "lora_A" else ("out", "r")
    return "[" + ", ".join(n if w is None else f"{n}={w}" for n, w in zip(names, want, strict=True)) + "]"


def _finite(a: AdapterDir) -> Iterator[str]:
    for key, t in a.tensors.items():
        if t.dtype not in LORA_DTYPES:
            yield f"{key}: dtype {str(t.dtype).removeprefix('torch.')}, a LoRA weight is one of {_LORA_DTYPE_NAMES}"
            continue
        if t.is_floating_point() and not all_finite(t):
            yield f"{key}: holds NaN/Inf"


def _selection(a: AdapterDir) -> Iterator[str]:
    d, got = a.dialect, a.config.get("target_modules")
    if d is None or not a.modules or not _valid_target_modules(got):
        return  # reported by names / config
    if a.base_names is None:
        if got != d.target_modules(list(a.modules)):
            yield (
                f"{a.config_file}: target_modules {got!r} does not select exactly the {len(a.modules)} exported modules"
            )
        return
    selected = selected_modules(got, a.base_names.selectable(d.name))
    if isinstance(got, str):
        extra, absent = sorted(selected - set(a.modules)), sorted(set(a.modules) - selected)
    else:
        leaves = {m.rsplit(".", 1)[-1] for m in a.modules}
        extra, absent = sorted(set(got or []) - leaves), sorted(leaves - set(got or []))
    yield from (f"target_modules also selects {m} (no tensors for it in the adapter)" for m in extra[:20])
    yield from (f"target_modules does not select {m}, which has adapter tensors" for m in absent[:20])


def selected_modules(target_modules: Any, base_modules: Mapping[str, str]) -> set[str]:
    """Base modules (dialect paths) that PEFT's target_modules would wrap: str = fullmatch, list = leaf/suffix."""
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return {m for m in base_modules if rx.fullmatch(m)}
    leaves = set(target_modules or [])
    return {m for m in base_modules if m.rsplit(".", 1)[-1] in leaves}


def _fingerprint(a: AdapterDir) -> Iterator[str]:
    if a.fingerprint_base is None:
        return
    try:
        recorded = read_adapter_fingerprint(a.path)
    except ValueError as exc:  # the metadata entry is not JSON
        yield f"{a.tensor_file}: unreadable base fingerprint metadata ({exc})"
        return
    if recorded is None:
        yield f"{a.tensor_file}: records no base fingerprint; cannot prove which base it was trained on"
        return
    if not _fingerprint_shape(recorded):
        yield f"{a.tensor_file}: the base fingerprint metadata is not a dsv4-lora fingerprint"
        return
    try:
        verify_fingerprint(recorded, a.fingerprint_base, config=a.base_config)
    except FingerprintMismatchError as exc:  # names each differing tensor
        yield str(exc)


def _fingerprint_shape(recorded: Any) -> bool:
    tensors = recorded.get("tensors") if isinstance(recorded, dict) else None
    fields = ("shape", "dtype", "sha256")
    return isinstance(tensors, dict) and all(
        isinstance(r, dict) and all(f in r for f in fields) for r in tensors.values()
    )


class AdapterCheck(NamedTuple):
    """One check: its name, the function yielding its problems, what a pass reports, and the error type the
    raising reporter uses. ``blocking``: later checks need it to pass (they read what it found readable)."""

    name: str
    problems: Callable[[AdapterDir], Iterator[str]]
    figure: Callable[[AdapterDir], str]
    error: type[Exception] = AdapterValidationError
    blocking: bool = False


def _marker_figure(a: AdapterDir) -> str:
    return f"certifies {len(a.marker['files'])} files" if a.marker else "no .complete (not required)"


#: THE list: validate_adapter_dir and verify-adapter both run these, in this order.
ADAPTER_CHECKS: tuple[AdapterCheck, ...] = (
    AdapterCheck("files", _files, lambda a: "present", blocking=True),
    AdapterCheck("marker", _marker, _marker_figure),
    AdapterCheck("config", _config, lambda a: f"LoRA r={a.config.get('r')} alpha={a.config.get('lora_alpha')}"),
    AdapterCheck("names", _names, lambda a: f"{len(a.modules)} modules, dialect {a.metadata.get('dsv4_dialect')}"),
    AdapterCheck("halves", _halves, lambda a: "lora_A and lora_B for every module"),
    AdapterCheck("shapes", _shapes, lambda a: "agree with r" + (" and the base" if a.base_names else "")),
    AdapterCheck("finite", _finite, lambda a: f"{len(a.tensors)} tensors"),
    AdapterCheck("selection", _selection, lambda a: "target_modules selects exactly the adapter's modules"),
    AdapterCheck(
        "fingerprint",
        _fingerprint,
        lambda a: "matches the base" if a.fingerprint_base is not None else "not checked (no base given)",
        error=FingerprintMismatchError,
    ),
)


class CheckReport(NamedTuple):
    name: str
    problems: list[str]
    figure: str


def list_problems(adapter: AdapterDir, checks: Sequence[AdapterCheck] = ADAPTER_CHECKS) -> list[CheckReport]:
    """Reporter 1: run every check and list every problem (stops only after a failed blocking check)."""
    reports = []
    for check in checks:
        problems = list(_guarded(check, adapter))
        figure = f"{len(problems)} problem(s)" if problems else _guarded_figure(check, adapter)
        reports.append(CheckReport(check.name, problems, figure))
        if problems and check.blocking:
            break
    return reports


def raise_first_problem(adapter: AdapterDir, checks: Sequence[AdapterCheck] = ADAPTER_CHECKS) -> None:
    """Reporter 2: raise the first problem of the first failing check as that check's error type."""
    for check in checks:
        for problem in _guarded(check, adapter):
            raise check.error(problem)


#: Last resort: what a check stumbles on becomes its problem (naming the adapter and the check), not a traceback.
#: Every known bad input is caught by name in the checks above; the suites fail if this is ever reached.
UNCHECKED = "could not be checked"


def _guarded(check: AdapterCheck, adapter: AdapterDir) -> Iterator[str]:
    found = check.problems(adapter)
    while True:
        try:
            problem = next(found)
        except StopIteration:
            return
        except Exception as exc:
            yield f"{adapter.path}: {check.name} {UNCHECKED} ({type(exc).__name__}: {exc})"
            return
        yield problem


def _guarded_figure(check: AdapterCheck, adapter: AdapterDir) -> str:
    try:
        return check.figure(adapter)
    except Exception as exc:
        return f"{check.name} {UNCHECKED} ({type(exc).__name__})"


def validate_adapter_dir(
    adapter_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    base_config: Mapping[str, Any] | None = None,
    require_complete: bool = True,
) -> dict[str, Any]:
    """Fully check an exported adapter (every check of :data:`ADAPTER_CHECKS`; the fingerprint against ``base``
    when given). Returns ``{"config", "modules", "marker"}``; raises :class:`AdapterValidationError` (or
    :class:`FingerprintMismatchError`) naming the offending file/tensor."""
    adapter = AdapterDir(Path(adapter_dir), require_complete, fingerprint_base=base, base_config=base_config)
    raise_first_problem(adapter)
    return {"config": adapter.config, "modules": sorted(adapter.modules), "marker": adapter.marker}


__all__ = [
    "ADAPTER_CHECKS",
    "AdapterCheck",
    "AdapterDir",
    "AdapterValidationError",
    "BaseNames",
    "CheckReport",
    "list_problems",
    "raise_first_problem",
    "selected_modules",
    "validate_adapter_dir",
]
