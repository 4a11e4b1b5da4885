"""The checks of an exported adapter directory: ONE list, two reporters.

:data:`ADAPTER_CHECKS` is the list; each check is a named function over an :class:`AdapterDir` (the directory
read once) that yields its problems, its docstring saying when. :func:`validate_adapter_dir` raises at the first
problem (the exporter's and the library's view); :func:`list_problems` runs every check and lists them all
(``dsv4-lora verify-adapter``)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from impl.adapter.dialects import DIALECTS, PEFT_PREFIX, Dialect
from impl.adapter.files import ADAPTER_FILE, COMPLETE_MARKER, CONFIG_FILE, file_sha256
from impl.adapter.fingerprint import (
    FingerprintCheck,
    FingerprintMismatchError,
    read_adapter_fingerprint,
    verify_fingerprint,
)
from impl.adapter.kinds import ModuleKind, place_module
from impl.adapter.raw import RawTensor, all_finite, read_safetensors
from impl.conversion.headers import SAMPLE_PAGES
from impl.errors import AdapterValidationError
from impl.vocabulary import TARGET_TABLE

if TYPE_CHECKING:
    import torch


#: what PEFT loads a LoRA weight as (FP8 / integer tensors are not adapters)
LORA_DTYPES = ("float32", "bfloat16", "float16", "float64")
_LORA_DTYPE_NAMES = ", ".join(LORA_DTYPES)
_TENSOR_RE = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight")
_MAIN_RE = re.compile(r"(?:layers\.[0-9]+|mtp\.[0-9]+)\.attn\.([a-z_0-9]+)\.weight")
_LAYER_PREFIX = re.compile(r"^(?:layers|mtp)\.[0-9]+\.(?:attn\.|ffn\.)?")
_MAGNITUDE_RE = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?")


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
    require_certified: bool = False  # an uncertified adapter (no marker or no fingerprint) is a problem
    base_names: BaseNames | None = None  # name/shape/selection checks against a base
    fingerprint_base: str | os.PathLike | Mapping[str, torch.Tensor] | None = None  # fingerprint check
    base_config: Mapping[str, Any] | None = None
    fingerprint_sampled: bool = False  # large weights not remembered compared by their samples
    fingerprint_check: FingerprintCheck | None = field(default=None, init=False)  # how it was compared
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
    def _safetensors(self) -> tuple[dict[str, str], dict[str, RawTensor]]:
        return read_safetensors(self.tensor_file)  # no torch: the checks read bytes, shapes and dtypes

    @property
    def metadata(self) -> dict[str, str]:
        return self._safetensors[0]

    @property
    def tensors(self) -> dict[str, RawTensor]:
        return self._safetensors[1]

    @cached_property
    def modules(self) -> dict[str, dict[str, RawTensor]]:
        """PEFT module path -> {"lora_A": tensor, "lora_B": tensor} (the halves present; ``.torch()`` for arithmetic)."""
        out: dict[str, dict[str, RawTensor]] = {}
        for key, t in self.tensors.items():
            m = _TENSOR_RE.fullmatch(key)
            if m is not None:
                out.setdefault(m[1], {})[m[2]] = t
        return out

    @property
    def dialect(self) -> Dialect | None:
        """The recorded dialect (our exports); a third-party adapter's is read off its module names."""
        recorded = self.metadata.get("dsv4_dialect")
        if recorded is not None:
            return DIALECTS.get(recorded)
        found = self.name_dialects
        return DIALECTS[next(iter(found))] if len(found) == 1 else None

    @cached_property
    def name_dialects(self) -> set[str]:
        """The dialects the module names are written in (a mix is a problem)."""
        places = [place_module(m) for m in self.modules]
        return {p.dialect for p in places if p is not None and p.kind is not ModuleKind.ROUTED_EXPERT}

    @cached_property
    def marker(self) -> dict[str, Any] | None:
        file = self.path / COMPLETE_MARKER
        if not file.is_file():
            return None
        doc = json.loads(file.read_text())
        if not isinstance(doc, dict):  # a `null` marker is present, not absent: it certifies nothing
            raise ValueError(f"a JSON {type(doc).__name__}, expected an object")
        return doc


def _files(a: AdapterDir) -> Iterator[str]:
    """``adapter_config.json`` / ``adapter_model.safetensors`` missing or unreadable, or pickle weights present
    (never unpickled here: ``dsv4-lora convert-adapter``)."""
    missing = [f for f in (a.config_file, a.tensor_file) if not f.is_file()]
    yield from (f"{a.path}: missing {f.name}" for f in missing)
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in a.path.glob(pattern))
    yield from (
        f"{a.path / p}: pickle weights are never unpickled implicitly (loading a pickle can run code); convert it "
        f"with `dsv4-lora convert-adapter --adapter {a.path} --out DIR2` (torch.load weights_only=True, then "
        "safetensors)"
        for p in pickles
    )
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
    """``.complete`` missing (when required), or it certifies other bytes than the files present (stale)."""
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
    """Not LoRA, ``r`` / ``lora_alpha`` invalid, DoRA, or a rank/alpha pattern that changes a module's scale."""
    cfg, file = a.config, a.config_file
    for key, want in (("peft_type", "LORA"), ("bias", "none"), ("task_type", "CAUSAL_LM")):
        if cfg.get(key) != want and not (key == "task_type" and cfg.get(key) is None):  # PEFT accepts None
            yield f"{file}: {key}={cfg.get(key)!r}, expected {want!r}"
    if cfg.get("use_dora"):
        mags = sum(1 for k in a.tensors if _MAGNITUDE_RE.fullmatch(k))
        yield (
            f"{file}: use_dora=True: a DoRA adapter ({mags} lora_magnitude_vector tensors): its delta is "
            "m*(W+s*B@A)/|W+s*B@A| - W, not s*B@A; PEFT applies it, no V4 serving engine's LoRA path nor "
            "dsv4-lora's export does"
        )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        yield f"{file}: r={r!r} must be a positive integer"
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 < alpha < float("inf"):  # NaN too
        yield f"{file}: lora_alpha={alpha!r} must be positive and finite"
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key)
        broken = [k for k in patterns if not _valid_target_modules(k)] if isinstance(patterns, Mapping) else []
        if broken:
            yield f"{file}: {key} key {broken[0]!r} is not a regular expression (PEFT matches each key as one)"
    yield from _pattern_scales(a)
    if not _valid_target_modules(cfg.get("target_modules")):
        yield f"{file}: target_modules={cfg.get('target_modules')!r} is neither a regular expression nor a list of names"


def pattern_value(patterns: Any, module: str, default: Any) -> Any:
    """The value PEFT gives ``module`` from ``rank_pattern`` / ``alpha_pattern``: the first key that matches the
    end of the module path on a dot boundary (PEFT's own rule), else ``default``."""
    for key, value in (patterns or {}).items() if isinstance(patterns, Mapping) else ():
        if _valid_target_modules(key) and re.match(rf"(.*\.)?({key})$", module):  # a broken key: _config names it
            return value
    return default


def _pattern_scales(a: AdapterDir) -> Iterator[str]:
    """A pattern that gives a module another r or alpha changes its scale: PEFT applies it, engines use one scale.
    Patterns that restate r and lora_alpha (Megatron-Bridge's save_hf_adapter writes one per module) change nothing."""
    cfg, file = a.config, a.config_file
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    for key, default in (("rank_pattern", r), ("alpha_pattern", alpha)):
        changed = {m: v for m in a.modules if (v := pattern_value(cfg.get(key), m, default)) != default}
        if changed:
            module, value = next(iter(changed.items()))
            yield (
                f"{file}: {key} gives {len(changed)} module(s) a value other than {default} (e.g. {module}: "
                f"{value}): PEFT scales those by their own alpha/r, a serving engine by lora_alpha/r for all"
            )


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
    """Tensors that are no PEFT LoRA tensors (one line per cause, counted), the dialect is unknown or mixed, or (with
    a base) modules that resolve to no base weight or are not main-attention targets (one line per kind, naming
    what each consumer does there)."""
    yield from _foreign_tensors(a)
    if not a.modules:
        yield f"{a.tensor_file}: no adapter tensors"
    recorded = a.metadata.get("dsv4_dialect")
    if recorded is not None and recorded not in DIALECTS:
        yield f"{a.tensor_file}: unknown dsv4_dialect {recorded!r}"
    elif len(a.name_dialects) > 1:
        yield f"{a.tensor_file}: module names mix the dialects {sorted(a.name_dialects)}"
    elif recorded is not None and a.name_dialects and recorded not in a.name_dialects:
        yield f"{a.tensor_file}: metadata says dialect {recorded!r}, the names are {next(iter(a.name_dialects))!r}"
    elif a.modules and a.dialect is None:
        yield f"{a.tensor_file}: the module names are in no V4 naming dialect (transformers, official, sglang)"
    if a.base_names is not None:
        yield from _module_kinds(a)


def _counted(items: list[str], what: str, then: str = "") -> str:
    """One problem line for one cause: how many, one example, and the consequence."""
    return f"{len(items)} {what}, e.g. {items[0]}" + (f"; {then}" if then else "")


def _foreign_tensors(a: AdapterDir) -> Iterator[str]:
    """Tensors that are no LoRA halves, grouped by cause (one line each)."""
    odd = [k for k in a.tensors if _TENSOR_RE.fullmatch(k) is None and _MAGNITUDE_RE.fullmatch(k) is None]
    unprefixed = [k for k in odd if _TENSOR_RE.fullmatch(PEFT_PREFIX + k)]
    saved = [k for k in odd if k.startswith(PEFT_PREFIX) and place_module(k.removeprefix(PEFT_PREFIX))]
    other = [k for k in odd if k not in unprefixed and k not in saved]
    if unprefixed:
        yield _counted(
            unprefixed,
            f"tensors lack the {PEFT_PREFIX!r} prefix PEFT needs",
            "PeftModel.from_pretrained would load none of them",
        )
    if saved:
        kinds = sorted({str(place_module(k.removeprefix(PEFT_PREFIX)).kind) for k in saved})
        yield _counted(
            saved,
            f"full weights (modules_to_save={a.config.get('modules_to_save')!r}: {', '.join(kinds)})",
            "PEFT replaces the base's weight with each; they are no LoRA delta, and no V4 serving engine's LoRA "
            "path nor dsv4-lora's export carries them",
        )
    if other:
        yield _counted(other, "tensors are not PEFT LoRA tensor names (base_model.model.<module>.lora_A|B.weight)")


def _module_kinds(a: AdapterDir) -> Iterator[str]:
    """With a base: each module's kind; every module that is not a main-attention target, one line per kind."""
    from impl.adapter.consumers import OFF_TARGET_HAZARD, off_target_consequence

    main = sorted({row.official for row in TARGET_TABLE.main})
    unknown, absent, by_kind = [], {}, {}
    for module in a.modules:
        place = place_module(module)
        official = a.base_names.official_of(module)
        if place is None:
            unknown.append(module)
        elif place.kind is not ModuleKind.MAIN:
            by_kind.setdefault(place.kind, []).append(module)
        elif official is None or official not in a.base_names.shapes:
            absent.setdefault(official or "unknown name", []).append(module)
    if unknown:
        yield _counted(unknown, "modules name nothing of a V4 base in any dialect")
    for official, modules in absent.items():
        yield f"{modules[0]}: resolves to no base tensor ({official})" + (
            f" (and {len(modules) - 1} more)" if len(modules) > 1 else ""
        )
    dialect = a.dialect.name if a.dialect else "transformers"
    for kind, modules in by_kind.items():
        leaves = sorted({_LAYER_PREFIX.sub("", place_module(m).official or m) for m in modules})
        hazard = OFF_TARGET_HAZARD.get(str(kind))
        yield _counted(
            modules,
            f"modules are {kind} modules ({', '.join(leaves)}), not the main attention projections {main}",
            (f"{hazard}; " if hazard else "") + off_target_consequence(str(kind), dialect),
        )


def _halves(a: AdapterDir) -> Iterator[str]:
    """A module has only ``lora_A`` or only ``lora_B``."""
    for module, halves in a.modules.items():
        if set(halves) != {"lora_A", "lora_B"}:
            yield f"{module}: only {sorted(halves)} present"


def _shapes(a: AdapterDir) -> Iterator[str]:
    """``lora_A [r, in]`` / ``lora_B [out, r]`` disagree with ``r`` (and with the base weight ``[out, in]``)."""
    for module, halves in a.modules.items():
        r = pattern_value(a.config.get("rank_pattern"), module, a.config.get("r"))
        official = a.base_names.official_of(module) if a.base_names is not None else None
        out_in = a.base_names.shapes.get(official) if a.base_names is not None and official else None
        if out_in is not None and len(out_in) != 2:
            yield f"{module}: the base weight {official} has shape {list(out_in)}, not a 2-D weight LoRA adapts"
            continue
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
    """A tensor is not float32/bf16/fp16/fp64, or holds NaN or Inf."""
    for key, t in a.tensors.items():
        if t.dtype not in LORA_DTYPES:
            yield f"{key}: dtype {str(t.dtype).removeprefix('torch.')}, a LoRA weight is one of {_LORA_DTYPE_NAMES}"
            continue
        if t.is_floating_point() and not all_finite(t):
            yield f"{key}: holds NaN/Inf"


def _selection(a: AdapterDir) -> Iterator[str]:
    """``target_modules`` does not select exactly the exported modules."""
    d, got = a.dialect, a.config.get("target_modules")
    if d is None or not a.modules or not _valid_target_modules(got):
        return  # reported by names / config
    if a.base_names is None:
        if "dsv4_dialect" not in a.metadata:  # a third-party spec: without the base only coverage is checkable
            absent = sorted(set(a.modules) - selected_modules(got, dict.fromkeys(a.modules, "")))
            if absent:
                yield _counted(absent, "modules with adapter tensors are not selected by target_modules")
        elif got != d.target_modules(list(a.modules)):
            yield (
                f"{a.config_file}: target_modules {got!r} does not select exactly the {len(a.modules)} exported modules"
            )
        return
    if isinstance(got, list) and d.target_modules_style == "leaves":  # vLLM/SGLang read a list as module leaves
        leaves = {m.rsplit(".", 1)[-1] for m in a.modules}
        extra, absent = sorted(set(got) - leaves), sorted(leaves - set(got))
    else:
        selected = selected_modules(got, a.base_names.selectable(d.name))
        extra, absent = sorted(selected - set(a.modules)), sorted(set(a.modules) - selected)
    if extra:
        yield _counted(extra, "modules target_modules also selects have no tensors in the adapter")
    if absent:
        yield _counted(absent, "modules with adapter tensors are not selected by target_modules")


def selected_modules(target_modules: Any, base_modules: Mapping[str, str]) -> set[str]:
    """Base modules (dialect paths) that PEFT's target_modules would wrap: str = fullmatch, list = PEFT's suffix
    match (the module path is an entry or ends with ``.`` + an entry)."""
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return {m for m in base_modules if rx.fullmatch(m)}
    wanted = set(target_modules or [])
    return {m for m in base_modules if m in wanted or any(m.endswith("." + t) for t in wanted)}


def _fingerprint(a: AdapterDir) -> Iterator[str]:
    """(With a base) the adapter records a fingerprint of another base."""
    if a.fingerprint_base is None:
        return
    try:
        recorded = read_adapter_fingerprint(a.path)
    except ValueError as exc:  # the metadata entry is not JSON
        yield f"{a.tensor_file}: unreadable base fingerprint metadata ({exc})"
        return
    if recorded is None:
        return  # uncertified, not wrong: the provenance check says so
    if not _fingerprint_shape(recorded):
        yield f"{a.tensor_file}: the base fingerprint metadata is not a dsv4-lora fingerprint"
        return
    try:
        a.fingerprint_check = verify_fingerprint(
            recorded, a.fingerprint_base, config=a.base_config, sampled=a.fingerprint_sampled
        )
    except FingerprintMismatchError as exc:  # names each differing tensor
        yield str(exc)


def _fingerprint_shape(recorded: Any) -> bool:
    tensors = recorded.get("tensors") if isinstance(recorded, dict) else None
    fields = ("shape", "dtype", "sha256")
    return isinstance(tensors, dict) and all(
        isinstance(r, dict) and all(f in r for f in fields) for r in tensors.values()
    )


def unproven(a: AdapterDir) -> list[str]:
    """What this adapter cannot prove: no ``.complete`` (completeness), no base fingerprint (which base)."""
    present = (a.path / COMPLETE_MARKER).exists()  # an unreadable one is the marker check's finding
    missing = [] if present else [f"no {COMPLETE_MARKER} marker (its completeness cannot be proven)"]
    try:
        recorded = read_adapter_fingerprint(a.path)
    except ValueError:  # proves nothing, whether or not a base is given to check it against
        missing.append("an unreadable base fingerprint (the base it was trained on cannot be proven)")
        return missing
    if recorded is None:
        missing.append("no base fingerprint (the base it was trained on cannot be proven)")
    return missing


def _provenance(a: AdapterDir) -> Iterator[str]:
    """(Only when certification is required) no ``.complete`` or no base fingerprint: a third-party adapter is
    *uncertified*, not wrong."""
    missing = unproven(a)
    if missing and a.require_certified:
        yield f"{a.path}: uncertified ({'; '.join(missing)}) and certification is required"


def _provenance_figure(a: AdapterDir) -> str:
    missing = unproven(a)
    if missing:
        return "uncertified: " + "; ".join(missing)
    return "certified: .complete and base fingerprint recorded"


class AdapterCheck(NamedTuple):
    """One check: its name, the function yielding its problems, what a pass reports, and the error type the
    raising reporter uses. ``blocking``: later checks need it to pass (they read what it found readable)."""

    name: str
    problems: Callable[[AdapterDir], Iterator[str]]
    figure: Callable[[AdapterDir], str]
    error: type[Exception] = AdapterValidationError
    blocking: bool = False


def lora_scale(config: Mapping[str, Any]) -> float:
    """The factor PEFT multiplies ``B@A`` by: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / (r**0.5 if config.get("use_rslora") else r)


def _config_figure(a: AdapterDir) -> str:
    cfg = a.config
    figure = f"LoRA r={cfg.get('r')} alpha={cfg.get('lora_alpha')}"
    if cfg.get("use_rslora"):
        figure += f", rsLoRA: scale alpha/sqrt(r) = {lora_scale(cfg):g}"
    return figure


def _dialect_figure(a: AdapterDir) -> str:
    name = a.dialect.name if a.dialect else None
    return f"{name} (read off the names)" if "dsv4_dialect" not in a.metadata and name else str(name)


def _fingerprint_figure(a: AdapterDir) -> str:
    if read_adapter_fingerprint(a.path) is None:
        return "none recorded (see provenance)"
    if a.fingerprint_base is None:
        return "not checked (no base given)"
    how = a.fingerprint_check
    if how is None or not how.sampled:
        return "matches the base" + (f" (every byte of {how.full} tensors)" if how else "")
    return (
        f"matches the base ({how.full} tensors by every byte, {how.sampled} by {SAMPLE_PAGES} sampled pages: "
        "--full-hash compares every byte)"
    )


def _marker_figure(a: AdapterDir) -> str:
    try:
        return f"certifies {len(a.marker['files'])} files" if a.marker else "no .complete (see provenance)"
    except (ValueError, KeyError, TypeError):
        return "unreadable .complete"


#: THE list: validate_adapter_dir and verify-adapter both run these, in this order.
ADAPTER_CHECKS: tuple[AdapterCheck, ...] = (
    AdapterCheck("files", _files, lambda a: "present", blocking=True),
    AdapterCheck("marker", _marker, _marker_figure),
    AdapterCheck("config", _config, _config_figure),
    AdapterCheck("names", _names, lambda a: f"{len(a.modules)} modules, dialect {_dialect_figure(a)}"),
    AdapterCheck("halves", _halves, lambda a: "lora_A and lora_B for every module"),
    AdapterCheck("shapes", _shapes, lambda a: "agree with r" + (" and the base" if a.base_names else "")),
    AdapterCheck("finite", _finite, lambda a: f"{len(a.tensors)} tensors"),
    AdapterCheck("selection", _selection, lambda a: "target_modules selects exactly the adapter's modules"),
    AdapterCheck(
        "fingerprint",
        _fingerprint,
        lambda a: _fingerprint_figure(a),
        error=FingerprintMismatchError,
    ),
    AdapterCheck("provenance", _provenance, _provenance_figure),
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
    require_certified: bool | None = None,
) -> dict[str, Any]:
    """Fully check an exported adapter (every check of :data:`ADAPTER_CHECKS`; the fingerprint against ``base``
    when given). Returns ``{"config", "modules", "marker"}``; raises :class:`AdapterValidationError` (or
    :class:`FingerprintMismatchError`) naming the offending file/tensor. ``require_certified`` (default: when a
    base is given) also refuses an adapter that records no fingerprint or has no marker."""
    certified = base is not None if require_certified is None else require_certified
    adapter = AdapterDir(Path(adapter_dir), require_complete, certified, fingerprint_base=base, base_config=base_config)
    raise_first_problem(adapter)
    return {"config": adapter.config, "modules": sorted(adapter.modules), "marker": adapter.marker}


__all__ = [
    "validate_adapter_dir",
]
