"""``dsv4-lora verify-adapter``: check an existing PEFT adapter against a base, listing every problem.

Reads the base's safetensors headers and ``config.json`` only (so it works on a full-size Flash or
Pro base); the adapter's own tensors are small and are read in full. Each problem names the tensor.
The checks are :data:`impl.adapter.validation.ADAPTER_CHECKS` (the exporter's own, see the table there), here
against the base's names and shapes, plus the opt-in ``forward`` check: PEFT's merged model must equal the base
with ``W + s*B@A`` applied by hand. Names are translated through the target table (:mod:`impl.lora.vocabulary`)
and the naming dialects (:mod:`impl.adapter.dialects`); every other module of a V4 base resolves to its kind
(:mod:`impl.adapter.kinds`), so an adapter from any producer is judged by what it wraps. Provenance (``.complete``,
the base fingerprint) is its own line: an adapter without them is *uncertified*, which fails only with
``require_certified``; one that has them is held to them.
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
    require_certified: bool = False,
    full_hash: bool = False,
) -> VerifyResult:
    """The ``base`` check (:func:`impl.conversion.base_dir.inspect_base`: DeepSeek-V4, shards, headers), then every
    check of :data:`ADAPTER_CHECKS` against it (plus ``forward`` when asked). Never raises on a bad adapter or base:
    every problem is listed, naming its file or tensor. With a bad base the adapter is still checked on its own.
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
    if forward and res.ok:
        from impl.adapter.validation import lora_scale

        try:
            res.checks.append(_forward_check(base, adapter, view.modules, lora_scale(view.config), res))
        except Exception as exc:  # transformers / PEFT refusing this base or adapter is a finding about them
            res.problems.append(f"{base}: the forward check could not run ({type(exc).__name__}: {exc})")
            res.checks.append(VerifyCheck("forward", False, "could not run"))
    elif forward:
        res.checks.append(VerifyCheck("forward", None, "skipped: the adapter or base has problems"))
    return res


def _base_figure(read) -> str:
    if not read.ok:
        return f"{len(read.problems)} problem(s); adapter checked without the base"
    files = len({h.file for h in read.headers.values()})
    layout = f", {read.layout_note}" if read.layout_note else ""
    return f"DeepSeek-V4, {len(read.headers)} tensors in {files} shard(s){layout}"


def _load_transformers(base: Path):
    """transformers' ``DeepseekV4ForCausalLM`` of ``base`` in fp32, and the load problems (MTP is not modelled)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(str(base), dtype=torch.float32, output_loading_info=True)
    problems = [
        f"forward: transformers could not load {base} cleanly ({kind}: {', '.join(map(str, keys[:5]))})"
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if (keys := [k for k in info.get(kind, ()) if not str(k).startswith("mtp.")])
    ]
    return model.eval(), problems


def _forward_check(base: Path, adapter: Path, modules, scale: float, res: VerifyResult) -> VerifyCheck:
    """PEFT merged and unmerged (grouped o_a_proj layer) vs the base with ``W + s·B@A`` applied by hand
    (``s``: :func:`impl.adapter.validation.lora_scale`; transformers dialect only)."""
    import torch
    from transformers import AutoConfig

    from impl.cli.logits import LOGIT_CHECKS, compare_logits
    from impl.lora.peft_loader import load_peft_adapter
    from impl.native.config import V4Config

    places = [place_module(m) for m in modules]
    if not modules or not all(p is not None and p.dialect == "transformers" for p in places):
        return VerifyCheck("forward", None, "only for transformers-dialect adapters")
    cfg = AutoConfig.from_pretrained(base)
    seq = V4Config.from_hf(cfg).min_seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    manual, problems = _load_transformers(base)
    if problems:
        res.problems += problems
        return VerifyCheck("forward", False, "base does not load in transformers")
    with torch.no_grad():
        for module, h in modules.items():
            weight = manual.get_submodule(module).weight
            weight += scale * (h["lora_B"].torch().float() @ h["lora_A"].torch().float()).to(weight.dtype)
        want = manual(ids).logits
        plain = _load_transformers(base)[0](ids).logits
        merged = load_peft_adapter(_load_transformers(base)[0], adapter, merge=True)(ids).logits
        unmerged = load_peft_adapter(_load_transformers(base)[0], adapter).eval()(ids).logits
    # qualify's float32 rule: the two sides differ by rounding only, relative to the logits' scale
    cmps = {
        mode: compare_logits(got, want, LOGIT_CHECKS["float32"])
        for mode, got in (("merged", merged), ("unmerged", unmerged))
    }
    for mode, cmp in cmps.items():
        if not cmp.passed:
            res.problems.append(
                f"forward: PEFT {mode} logits differ from W + s*B@A by {cmp.observed:.2e} (tolerance {cmp.tolerance:.1e})"
            )
    ok = all(c.passed for c in cmps.values())
    tol = cmps["merged"].tolerance
    effect = (want - plain).abs().max().item()
    figure = f"max|Δ| merged {cmps['merged'].observed:.2e}, unmerged {cmps['unmerged'].observed:.2e} (tol {tol:.1e})"
    if ok and effect <= tol:  # e.g. an untrained adapter (lora_B = 0): equal logits prove nothing about the delta
        return VerifyCheck("forward", None, f"inconclusive: the adapter moves the logits by {effect:.1e} <= {figure}")
    return VerifyCheck("forward", ok, f"{figure}; the adapter moves them by {effect:.1e}")
