"""``dsv4-lora verify-adapter``: check an existing PEFT adapter against a base, listing every problem.

Reads the base's safetensors headers and ``config.json`` only, so it works on a full-size Flash or Pro base. The
checks are the exporter's own (:data:`impl.adapter.validation.ADAPTER_CHECKS`); every module resolves to its kind
(:mod:`impl.adapter.kinds`), so an adapter from any producer is judged by what it wraps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.adapter.kinds import dialect_module, place_module

__all__ = [
    "VerifyResult",
    "verify_adapter",
]


@dataclass
class VerifyCheck:
    name: str
    passed: bool | None
    figure: str
    status: str | None = None  # shown instead of PASS/FAIL/n/a (provenance: CERTIFIED / UNCERTIFIED)


@dataclass
class VerifyResult:
    checks: list[VerifyCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.passed is not False for c in self.checks)

    @property
    def uncertified(self) -> str | None:
        """Why the adapter's base and completeness cannot be proven (None: certified, or never checked)."""
        row = next((c for c in self.checks if c.name == "provenance"), None)
        return row.figure if row is not None and row.status == "UNCERTIFIED" else None


def _official_base_of(module: str) -> str | None:
    """The official base weight a PEFT module path (any dialect) adapts, or None."""
    place = place_module(module)
    return None if place is None else place.official_weight


_NUMBER = re.compile(r"\d+")


def _dialect_paths(headers: dict[str, Any], dialect: str) -> dict[str, str]:
    """Dialect module path -> official weight name, for every 2-D base weight PEFT could wrap in ``dialect``.

    A full-size base has ~34k such weights, nearly all per-expert ones of a few name families: where a family's
    first name maps with its layer/expert numbers carried over in order, the rest of the family is filled in from
    that template instead of being resolved one by one."""
    out: dict[str, str] = {}
    families: dict[str, str | None] = {}  # family -> module template, or "" where the dialect has no such module
    for name, (shape, _) in headers.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        official = name.removesuffix(".weight")
        numbers = _NUMBER.findall(official)
        family = _NUMBER.sub("#", official)
        template = families.get(family)
        if template == "":
            continue
        if template is not None:
            module = template.replace("#", "{}").format(*numbers)
        else:
            module = dialect_module(official, dialect)
            if family not in families and (module is None or _NUMBER.findall(module) == numbers):
                families[family] = "" if module is None else _NUMBER.sub("#", module)
            else:
                families[family] = None  # numbers not carried over in order: resolve each name
        if module is not None:
            out[module] = name
    return out


def verify_adapter(
    base: str | Path,
    adapter: str | Path,
    *,
    forward: bool = False,
    judge: bool = False,
    require_certified: bool = False,
    full_hash: bool = False,
) -> VerifyResult:
    """The ``base`` check (:func:`impl.conversion.base_dir.inspect_base`: DeepSeek-V4, shards, headers), then every
    check of :data:`ADAPTER_CHECKS` against it (plus ``forward`` when asked; ``judge`` or ``forward``: the conformance
    judge's verdict, which imports torch and transformers). Never raises on a bad adapter or base:
    every problem is listed, naming its file or tensor. With a bad base the adapter is still checked on its own.
    ``forward``: PEFT's merged model must equal the base with ``W + s*B@A`` applied by the conformance judge's
    oracle; the judge's own verdict is the ``conformance`` row. Provenance is its own row, held to where present.
    An adapter without ``.complete`` or base fingerprint is uncertified (:attr:`VerifyResult.uncertified`): a
    problem only with ``require_certified``. The fingerprint is compared by sampled pages where a large weight's
    full digest is not remembered, unless ``full_hash`` (:mod:`impl.adapter.fingerprint`)."""
    from impl.adapter.validation import AdapterDir, BaseNames, list_problems
    from impl.conversion.base_dir import inspect_base

    base, adapter = Path(base), Path(adapter)
    read = inspect_base(base)
    res = VerifyResult(problems=[p.message for p in read.problems])
    res.checks.append(VerifyCheck("base", read.ok, _base_figure(read)))
    names = None
    if read.ok:
        headers = {name: (h.shape, h.dtype) for name, h in read.headers.items()}
        names = BaseNames(
            shapes={name: shape for name, (shape, _) in headers.items()},
            official_of=_official_base_of,
            selectable=lambda dialect: _dialect_paths(headers, dialect),
        )
    view = AdapterDir(
        adapter,
        False,
        require_certified,
        base_names=names,
        fingerprint_base=base if read.ok else None,
        fingerprint_sampled=not full_hash,
    )
    for report in list_problems(view):
        res.problems += report.problems
        status = None
        if report.name == "provenance" and not report.problems:
            status = "UNCERTIFIED" if report.figure.startswith("uncertified") else "CERTIFIED"
        res.checks.append(VerifyCheck(report.name, not report.problems, report.figure, status))
    if judge or forward:
        res.checks.append(_judge_check(base, adapter, view.modules, res) if read.ok else _NO_JUDGE)
    if forward and res.ok:
        try:
            res.checks.append(_forward_check(base, adapter, view.modules, res))
        except Exception as exc:  # transformers / PEFT refusing this base or adapter is a finding about them
            res.problems.append(f"{base}: the forward check could not run ({type(exc).__name__}: {exc})")
            res.checks.append(VerifyCheck("forward", False, "could not run"))
    elif forward:
        res.checks.append(VerifyCheck("forward", None, "skipped: the adapter or base has problems"))
    return res


def _transformers_named(modules) -> bool:
    """Every module is named as transformers' model names it (what the judge and PEFT's reload read)."""
    places = [place_module(m) for m in modules]
    return bool(modules) and all(p is not None and p.dialect == "transformers" for p in places)


_NO_JUDGE = VerifyCheck("conformance", None, "skipped: the base has problems")


def _judge_check(base: Path, adapter: Path, modules, res: VerifyResult) -> VerifyCheck:
    """The conformance judge's verdict (:func:`dsv4_conformance.judge.artifacts.judge_adapter_dir`, which imports no
    implementation) on a PEFT adapter for transformers' model. Its problems are listed only where the checks
    above found none: then it caught what they missed; otherwise they are the same causes seen twice."""
    from dsv4_conformance.judge.artifacts import judge_adapter_dir

    if not _transformers_named(modules):
        return VerifyCheck("conformance", None, "only for adapters in transformers' naming (what PEFT loads)")
    problems = [str(p) for p in judge_adapter_dir(adapter, base)]
    if not problems:
        return VerifyCheck("conformance", True, "dsv4_conformance.judge: a valid PEFT adapter for this base")
    if not res.problems:
        res.problems += [f"conformance: {p}" for p in problems]
        return VerifyCheck("conformance", False, f"dsv4_conformance.judge: {len(problems)} problem(s)")
    return VerifyCheck("conformance", False, f"dsv4_conformance.judge: {len(problems)} problem(s), e.g. {problems[0]}")


def _base_figure(read) -> str:
    if not read.ok:
        return f"{len(read.problems)} problem(s); adapter checked without the base"
    files = len({h.file for h in read.headers.values()})
    layout = f", {read.layout_note}" if read.layout_note else ""
    return f"DeepSeek-V4, {len(read.headers)} tensors in {files} shard(s){layout}"


def _forward_check(base: Path, adapter: Path, modules, res: VerifyResult) -> VerifyCheck:
    """The conformance judge's reload (:mod:`dsv4_conformance.judge.oracle`): PEFT's own merged reload on
    transformers, and the grouped layer unmerged (:func:`impl.load_peft_adapter`), against the base with
    ``W + s·B@A`` written out by the judge, held to the judge's :data:`LOGIT_RULE` (transformers naming only)."""
    import torch
    from transformers import AutoConfig

    from dsv4_conformance.judge.oracle import LOGIT_RULE, base_model, delta_logits, max_abs, peft_logits, read_adapter
    from impl.lora.peft_loader import load_peft_adapter
    from impl.native.config import V4Config

    if not _transformers_named(modules):
        return VerifyCheck("forward", None, "only for transformers-dialect adapters")
    cfg = AutoConfig.from_pretrained(base)
    seq = V4Config.from_hf(cfg).min_seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    model = base_model(base)  # strict: a base transformers cannot load cleanly is a problem of its own
    deltas, scale = read_adapter(adapter)
    with torch.no_grad():
        want = delta_logits(model, ids, deltas, scale)
        plain = model(ids).logits.float()
        merged = peft_logits(base, adapter, ids)
        unmerged = load_peft_adapter(base_model(base), adapter).eval()(ids).logits.float()
    tol = LOGIT_RULE.tolerance(want)
    observed = {"merged": max_abs(merged, want), "unmerged": max_abs(unmerged, want)}
    failing = {mode: diff for mode, diff in observed.items() if not diff <= tol}  # NaN fails too
    for mode, diff in failing.items():
        res.problems.append(f"forward: PEFT {mode} logits differ from W + s*B@A by {diff:.2e} (tolerance {tol:.1e})")
    ok = not failing
    effect = max_abs(want, plain)
    figure = f"max|Δ| merged {observed['merged']:.2e}, unmerged {observed['unmerged']:.2e} (tol {tol:.1e})"
    if ok and effect <= tol:  # e.g. an untrained adapter (lora_B = 0): equal logits prove nothing about the delta
        return VerifyCheck("forward", None, f"inconclusive: the adapter moves the logits by {effect:.1e} <= {figure}")
    return VerifyCheck("forward", ok, f"{figure}; the adapter moves them by {effect:.1e}")
