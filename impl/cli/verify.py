"""``dsv4-lora verify-adapter``: check an existing PEFT adapter against a base, listing every problem.

Reads the base's safetensors headers and ``config.json`` only (so it works on a full-size Flash or
Pro base); the adapter's own tensors are small and are read in full. Each problem names the tensor.
The checks are :data:`impl.adapter.validation.ADAPTER_CHECKS` (the exporter's own, see the table there), here
against the base's names and shapes, plus the opt-in ``forward`` check: PEFT's merged model must equal the base
with ``W + s*B@A`` applied by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.adapter.dialects import TARGETS

MAIN_OFFICIAL = {row.official for row in TARGETS}
_TF_MAIN = {row.transformers: row.official for row in TARGETS}


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


def _base_headers(base: Path) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    out: dict[str, tuple[list[int], str]] = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (list(sl.get_shape()), sl.get_dtype())
    return out


def _official_base_of(module: str) -> str | None:
    """The official base weight a PEFT module path (any of the three dialects) adapts, or None."""
    m = re.fullmatch(r"model\.layers\.([0-9]+)\.self_attn\.(.+)", module)
    if m:
        layer, rest = m.groups()
        if rest in _TF_MAIN:  # transformers dialect, main attention
            return f"layers.{layer}.attn.{_TF_MAIN[rest]}.weight"
        if rest in MAIN_OFFICIAL or rest.startswith(("indexer.", "compressor.")):  # sglang dialect
            return f"layers.{layer}.attn.{rest}.weight"
        from tiny_models.checkpoint import transformers_to_official_name

        try:
            return transformers_to_official_name(f"{module}.weight")
        except Exception:
            return None
    if re.fullmatch(r"(layers\.[0-9]+|mtp\.[0-9]+)\.attn\..+", module):  # official dialect
        return f"{module}.weight"
    return None


def _dialect_paths(headers: dict[str, Any], dialect: str) -> dict[str, str]:
    """Dialect module path -> official weight name, for every 2-D base weight a LoRA could wrap."""
    from tiny_models.checkpoint import official_to_transformers_name

    out = {}
    for name, (shape, _) in headers.items():
        if not name.endswith(".weight") or len(shape) != 2 or ".experts." in name or name.startswith("mtp."):
            continue
        if dialect == "official":
            out[name[: -len(".weight")]] = name
        elif dialect == "sglang":
            m = re.fullmatch(r"layers\.([0-9]+)\.attn\.(.+)\.weight", name)
            if m:
                out[f"model.layers.{m.group(1)}.self_attn.{m.group(2)}"] = name
        else:
            try:
                out[official_to_transformers_name(name)[: -len(".weight")]] = name
            except Exception:
                continue
    return out


def verify_adapter(base: str | Path, adapter: str | Path, *, forward: bool = False) -> VerifyResult:
    """Every check of :data:`ADAPTER_CHECKS` against ``base`` (plus ``forward`` when asked); never raises on a bad
    adapter (problems are listed)."""
    from impl.adapter.validation import AdapterDir, BaseNames, list_problems

    base, adapter = Path(base), Path(adapter)
    headers = _base_headers(base)
    names = BaseNames(
        shapes={name: shape for name, (shape, _) in headers.items()},
        official_of=_official_base_of,
        selectable=lambda dialect: _dialect_paths(headers, dialect),
    )
    view = AdapterDir(adapter, base_names=names, fingerprint_base=base)
    res = VerifyResult()
    for report in list_problems(view):
        res.problems += report.problems
        res.checks.append(VerifyCheck(report.name, not report.problems, report.figure))
    if forward and res.ok:
        cfg = view.config
        res.checks.append(_forward_check(base, adapter, view.modules, cfg["r"], cfg["lora_alpha"], res))
    elif forward:
        res.checks.append(VerifyCheck("forward", None, "skipped: the adapter has problems"))
    return res


def _forward_check(base: Path, adapter: Path, modules, r, alpha, res: VerifyResult) -> VerifyCheck:
    """PEFT merged and unmerged (grouped o_a_proj layer) vs the base with ``W + (alpha/r)·B@A`` applied by hand
    (transformers dialect only)."""
    import torch
    from transformers import AutoConfig

    from impl.lora.peft_loader import load_peft_adapter
    from tiny_models.checkpoint import load_oracle
    from tiny_models.presets import min_seq_len

    if not modules or not all(re.fullmatch(r"model\.layers\.[0-9]+\.self_attn\.[a-z_]+", m) for m in modules):
        return VerifyCheck("forward", None, "only for transformers-dialect adapters")
    cfg = AutoConfig.from_pretrained(base)
    ids = torch.randint(0, cfg.vocab_size, (1, min_seq_len(cfg)), generator=torch.Generator().manual_seed(0))
    manual = load_oracle(base)
    with torch.no_grad():
        for module, h in modules.items():
            weight = manual.get_submodule(module).weight
            weight += (alpha / r) * (h["lora_B"].float() @ h["lora_A"].float()).to(weight.dtype)
        want = manual(ids).logits
        merged = load_peft_adapter(load_oracle(base), adapter, merge=True)(ids).logits
        unmerged = load_peft_adapter(load_oracle(base), adapter).eval()(ids).logits
    diffs = {"merged": (merged - want).abs().max().item(), "unmerged": (unmerged - want).abs().max().item()}
    for mode, diff in diffs.items():
        if diff > 1e-5:
            res.problems.append(f"forward: PEFT {mode} logits differ from W + s*B@A by {diff:.2e}")
    ok = max(diffs.values()) <= 1e-5
    return VerifyCheck("forward", ok, f"max|Δ| merged {diffs['merged']:.2e}, unmerged {diffs['unmerged']:.2e}")
