"""``dsv4-lora verify-adapter``: check an existing PEFT adapter against a base, listing every problem.

Reads the base's safetensors headers and ``config.json`` only (so it works on a full-size Flash or
Pro base); the adapter's own tensors are small and are read in full. Each problem names the tensor.
The checks are :data:`impl.adapter.validation.ADAPTER_CHECKS` (the exporter's own, see the table there), here
against the base's names and shapes, plus the opt-in ``forward`` check: PEFT's merged model must equal the base
with ``W + s*B@A`` applied by hand. Names are translated through the target table (:mod:`impl.lora.vocabulary`)
and the naming dialects (:mod:`impl.adapter.dialects`); the modules ``target_modules`` may select are the
table's attention targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.adapter.dialects import DIALECTS, resolve_module
from impl.lora.vocabulary import TARGET_TABLE, TargetTable


@dataclass
class VerifyCheck:
    name: str
    passed: bool | None
    figure: str


@dataclass
class VerifyResult:
    checks: list[VerifyCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.passed is not False for c in self.checks)


def _official_base_of(module: str, table: TargetTable = TARGET_TABLE) -> str | None:
    """The official base weight a PEFT module path (any of the three dialects) adapts, or None."""
    ref = resolve_module(module, table)
    return None if ref is None else ref.official_weight


def _dialect_paths(headers: dict[str, Any], dialect: str, table: TargetTable = TARGET_TABLE) -> dict[str, str]:
    """Dialect module path -> official weight name, for every 2-D base weight of a table target."""
    out = {}
    for name, (shape, _) in headers.items():
        if not name.endswith(".weight") or len(shape) != 2 or name.startswith("mtp."):
            continue
        hit = DIALECTS["official"].parse_module(name.removesuffix(".weight"), table)
        if hit is not None:
            out[DIALECTS[dialect].module_name(*hit)] = name
    return out


def verify_adapter(base: str | Path, adapter: str | Path, *, forward: bool = False) -> VerifyResult:
    """The ``base`` check (:func:`impl.conversion.base_dir.inspect_base`: DeepSeek-V4, shards, headers), then every
    check of :data:`ADAPTER_CHECKS` against it (plus ``forward`` when asked). Never raises on a bad adapter or base:
    every problem is listed, naming its file or tensor. With a bad base the adapter is still checked on its own."""
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
    view = AdapterDir(adapter, base_names=names, fingerprint_base=base if read.ok else None)
    for report in list_problems(view):
        res.problems += report.problems
        res.checks.append(VerifyCheck(report.name, not report.problems, report.figure))
    if forward and res.ok:
        cfg = view.config
        try:
            res.checks.append(_forward_check(base, adapter, view.modules, cfg["r"], cfg["lora_alpha"], res))
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
    return f"DeepSeek-V4, {len(read.headers)} tensors in {files} shard(s)"


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


def _forward_check(base: Path, adapter: Path, modules, r, alpha, res: VerifyResult) -> VerifyCheck:
    """PEFT merged and unmerged (grouped o_a_proj layer) vs the base with ``W + (alpha/r)·B@A`` applied by hand
    (transformers dialect only)."""
    import torch
    from transformers import AutoConfig

    from impl.lora.peft_loader import load_peft_adapter
    from impl.native.config import V4Config

    refs = [resolve_module(m) for m in modules]
    if not modules or not all(ref is not None and ref.dialect == "transformers" for ref in refs):
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
            weight += (alpha / r) * (h["lora_B"].float() @ h["lora_A"].float()).to(weight.dtype)
        want = manual(ids).logits
        merged = load_peft_adapter(_load_transformers(base)[0], adapter, merge=True)(ids).logits
        unmerged = load_peft_adapter(_load_transformers(base)[0], adapter).eval()(ids).logits
    diffs = {"merged": (merged - want).abs().max().item(), "unmerged": (unmerged - want).abs().max().item()}
    for mode, diff in diffs.items():
        if diff > 1e-5:
            res.problems.append(f"forward: PEFT {mode} logits differ from W + s*B@A by {diff:.2e}")
    ok = max(diffs.values()) <= 1e-5
    return VerifyCheck("forward", ok, f"max|Δ| merged {diffs['merged']:.2e}, unmerged {diffs['unmerged']:.2e}")
