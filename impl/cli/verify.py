"""``dsv4-lora verify-adapter``: check an existing PEFT adapter against a base, listing every problem.

Reads the base's safetensors headers and ``config.json`` only (so it works on a full-size Flash or
Pro base); the adapter's own tensors are small and are read in full. Each problem names the tensor.

| check | problem when |
|---|---|
| ``files`` | ``adapter_config.json`` / ``adapter_model.safetensors`` missing, or pickle weights present |
| ``marker`` | ``.complete`` missing, or it certifies other bytes than the files present (stale) |
| ``config`` | not LoRA, ``r`` / ``lora_alpha`` missing or inconsistent with the tensors |
| ``names`` | a tensor does not resolve to a base module, or wraps something other than a main attention projection |
| ``selection`` | ``target_modules`` would wrap attention targets other than the adapter's (e.g. the indexer's ``q_b_proj``) |
| ``halves`` | a module has only ``lora_A`` or only ``lora_B`` |
| ``shapes`` | ``lora_A [r, in]`` / ``lora_B [out, r]`` disagree with the base weight ``[out, in]`` |
| ``finite`` | NaN or Inf in a tensor |
| ``fingerprint`` | the adapter was trained against another base (or records none) |
| ``forward`` (opt-in) | PEFT's merged model differs from the base with ``W + s*B@A`` applied by hand |

Names are translated through the target table (:mod:`impl.lora.vocabulary`) and the naming dialects
(:mod:`impl.adapter.dialects`): the candidate modules of ``selection`` are the table's attention targets.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.adapter.dialects import DIALECTS, PEFT_PREFIX, resolve_module
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _base_headers(base: Path) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    out: dict[str, tuple[list[int], str]] = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (list(sl.get_shape()), sl.get_dtype())
    return out


def _official_base_of(module: str, table: TargetTable = TARGET_TABLE) -> str | None:
    """The official base weight a PEFT module path (any of the three dialects) adapts, or None."""
    ref = resolve_module(module, table)
    return None if ref is None else ref.official_weight


def _is_main_attention(official: str, table: TargetTable = TARGET_TABLE) -> bool:
    ref = resolve_module(official.removesuffix(".weight"), table)
    return ref is not None and ref.dialect == "official" and ref.row.main


def _detect_dialect(modules, table: TargetTable = TARGET_TABLE) -> str:
    """The dialect the adapter's module paths are written in (official, else sglang, else transformers)."""
    found = {ref.dialect for ref in (resolve_module(m, table) for m in modules) if ref is not None}
    return next((d for d in ("official", "sglang") if d in found), "transformers")


def _selected(target_modules: Any, base_modules: dict[str, str]) -> set[str]:
    """Base modules (dialect paths) that PEFT's target_modules would wrap: str = fullmatch, list = leaf/suffix."""
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return {m for m in base_modules if rx.fullmatch(m)}
    leaves = set(target_modules or [])
    return {m for m in base_modules if m.rsplit(".", 1)[-1] in leaves}


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
    """Every check in the module docstring; never raises on a bad adapter (problems are listed)."""
    from safetensors import safe_open

    from impl.adapter.fingerprint import read_adapter_fingerprint, verify_fingerprint

    base, adapter = Path(base), Path(adapter)
    res = VerifyResult()
    cfg_file, st_file = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    missing = [p.name for p in (cfg_file, st_file) if not p.is_file()]
    pickles = [p.name for p in adapter.glob("*.bin")] + [p.name for p in adapter.glob("*.pt")]
    res.problems += [f"{adapter}: missing {m}" for m in missing]
    res.problems += [f"{adapter}/{p}: pickle weights are never accepted" for p in pickles]
    res.checks.append(VerifyCheck("files", not missing and not pickles, ", ".join(missing) or "present"))
    if missing:
        return res

    marker_file = adapter / ".complete"
    if not marker_file.is_file():
        res.problems.append(f"{marker_file}: missing; the export never completed (or was not made by dsv4-lora)")
        res.checks.append(VerifyCheck("marker", False, "no .complete"))
    else:
        try:
            files = json.loads(marker_file.read_text())["files"]
            stale = [n for n, d in files.items() if not (adapter / n).is_file() or _sha256(adapter / n) != d]
            uncovered = [p.name for p in (cfg_file, st_file) if p.name not in files]
        except (ValueError, KeyError, TypeError) as exc:
            stale, uncovered = [f"unreadable marker ({exc})"], []
        res.problems += [f"{marker_file}: stale - certifies different bytes for {n}" for n in stale]
        res.problems += [f"{marker_file}: does not certify {n}" for n in uncovered]
        res.checks.append(
            VerifyCheck("marker", not stale and not uncovered, f"certifies {len(files) if not stale else '?'} files")
        )

    config = json.loads(cfg_file.read_text())
    r, alpha = config.get("r"), config.get("lora_alpha")
    cfg_problems = []
    if config.get("peft_type") != "LORA":
        cfg_problems.append(f"{cfg_file}: peft_type={config.get('peft_type')!r}, expected 'LORA'")
    if not isinstance(r, int) or r <= 0:
        cfg_problems.append(f"{cfg_file}: r={r!r} must be a positive integer")
    if not isinstance(alpha, int | float) or alpha <= 0:
        cfg_problems.append(f"{cfg_file}: lora_alpha={alpha!r} must be positive")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        cfg_problems.append(f"{cfg_file}: rank_pattern/alpha_pattern are not produced for V4 adapters")

    headers = _base_headers(base)
    with safe_open(str(st_file), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    modules: dict[str, dict[str, Any]] = {}
    name_problems, shape_problems, finite_problems = [], [], []
    for key, t in tensors.items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            name_problems.append(f"{key}: not a PEFT LoRA tensor name (base_model.model.<module>.lora_A|B.weight)")
            continue
        module, half = m.groups()
        modules.setdefault(module, {})[half] = t
        if not bool(t.float().isfinite().all()):
            finite_problems.append(f"{key}: holds NaN/Inf")
    halves_problems = [f"{m}: only {sorted(h)} present" for m, h in modules.items() if set(h) != {"lora_A", "lora_B"}]

    dialect = meta.get("dsv4_dialect") or _detect_dialect(modules)
    for module, halves in modules.items():
        official = _official_base_of(module)
        if official is None or official not in headers:
            name_problems.append(f"{module}: resolves to no base tensor ({official or 'unknown name'})")
            continue
        if not _is_main_attention(official):
            name_problems.append(
                f"{module}: wraps {official}, not one of the main attention projections {list(TARGET_TABLE.main_names)} "
                "(indexer/compressor adapters are not portable)"
            )
        out_dim, in_dim = headers[official][0]
        a, b = halves.get("lora_A"), halves.get("lora_B")
        if a is not None and (a.dim() != 2 or list(a.shape) != [r, in_dim]):
            shape_problems.append(
                f"{module}.lora_A: shape {list(a.shape)}, expected [r={r}, in={in_dim}] for {official}"
            )
        if b is not None and (b.dim() != 2 or list(b.shape) != [out_dim, r]):
            shape_problems.append(
                f"{module}.lora_B: shape {list(b.shape)}, expected [out={out_dim}, r={r}] for {official}"
            )

    base_modules = _dialect_paths(headers, dialect)
    selected = _selected(config.get("target_modules"), base_modules)
    if isinstance(config.get("target_modules"), str):
        extra, absent = sorted(selected - set(modules)), sorted(set(modules) - selected)
    else:
        leaves = {m.rsplit(".", 1)[-1] for m in modules}
        extra = sorted(set(config.get("target_modules") or []) - leaves)
        absent = sorted(leaves - set(config.get("target_modules") or []))
    sel_problems = [f"target_modules also selects {m} (no tensors for it in the adapter)" for m in extra[:20]]
    sel_problems += [f"target_modules does not select {m}, which has adapter tensors" for m in absent[:20]]

    for name, probs, fig in (
        ("config", cfg_problems, f"LoRA r={r} alpha={alpha}"),
        ("names", name_problems, f"{len(modules)} modules, dialect {dialect}"),
        ("selection", sel_problems, f"target_modules selects {len(selected)} base modules"),
        ("halves", halves_problems, "lora_A and lora_B for every module"),
        ("shapes", shape_problems, "agree with base headers"),
        ("finite", finite_problems, f"{len(tensors)} tensors"),
    ):
        res.problems += probs
        res.checks.append(VerifyCheck(name, not probs, fig if not probs else f"{len(probs)} problem(s)"))

    if read_adapter_fingerprint(adapter) is None:
        res.problems.append(f"{st_file}: records no base fingerprint; cannot prove which base it was trained on")
        res.checks.append(VerifyCheck("fingerprint", False, "absent"))
    else:
        try:
            verify_fingerprint(adapter, base)
            res.checks.append(VerifyCheck("fingerprint", True, "matches the base"))
        except Exception as exc:  # FingerprintMismatchError names each differing tensor
            res.problems.append(f"fingerprint: {exc}")
            res.checks.append(VerifyCheck("fingerprint", False, "differs from the base"))

    if forward:
        res.checks.append(_forward_check(base, adapter, modules, r, alpha, res))
    return res


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
