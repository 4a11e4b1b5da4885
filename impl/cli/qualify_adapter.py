"""qualify's adapter steps on each rank: the collective export, the exported tensors held to the requested targets
x layers, and the reload on transformers + PEFT compared with the native model in float32, with the power of that
comparison measured, all by the judge's oracle and rule. ``run`` is qualify's per-rank state
(``impl.cli.qualify_rank._RankRun``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dsv4_conformance.judge.oracle import LOGIT_RULE, adapter_effects, base_model
from impl.vocabulary import TARGET_TABLE, TargetRow

__all__ = ["check_reload", "export", "exported_rows", "float32_logits"]


def exported_rows(targets: Any) -> list[TargetRow]:
    """The table rows of the exportable (main-attention) targets among ``targets`` (any accepted name), once each."""
    rows = (TARGET_TABLE.row(t) for t in targets)
    return list(dict.fromkeys(row for row in rows if row is not None and row.main))


def export(run: Any) -> Path:
    """``export`` (collective): the gather and the base's fingerprint run inside the export's phases, so a failure
    in either on any rank is every rank's error and nothing is published; then rank 0 holds the exported tensors
    to exactly the requested targets x layers."""
    import impl

    opts = run.opts
    run.progress.step("export adapter (gather, stage, validate, publish, .complete)")
    t0 = time.perf_counter()
    out = Path(opts.out) / "adapter"
    impl.export_adapter(
        lambda: impl.gather_adapter_state(run.chunks, run.handle),
        out,
        dialect=opts.dialect,
        base_model_name_or_path=str(run.base),
        fingerprint_base=run.base,
        timeout_s=opts.timeout_s / 4,
    )
    if run.rank == 0:
        files = sorted(p.name for p in out.iterdir())
        missing, unexpected = _exported_vs_requested(out, opts, run.hf_config.num_hidden_layers)
        complete = (out / impl.COMPLETE_MARKER).exists()
        wrong = "".join(
            f"; {kind} {len(names)}: {', '.join(names[:3])}"
            for kind, names in (("missing", missing), ("unexpected", unexpected))
            if names
        )
        run.record(
            "export",
            complete and not missing and not unexpected,
            f"{len(files)} files: {', '.join(files)}{wrong or '; tensors = requested targets x layers'}",
            t0,
            missing_tensors=missing,
            unexpected_tensors=unexpected,
        )
    return out


def _exported_vs_requested(out: Path, opts: Any, layers: int) -> tuple[list[str], list[str]]:
    """The LoRA tensors the requested targets in every layer call for that the export lacks, and the ones it has
    beyond them (the dialect's names; lora_A and lora_B of each module)."""
    from safetensors import safe_open

    from impl.adapter.dialects import DIALECTS, PEFT_PREFIX
    from impl.adapter.files import ADAPTER_FILE

    d = DIALECTS[opts.dialect]
    want = {
        f"{PEFT_PREFIX}{d.module_name(n, row)}.{half}.weight"
        for n in range(layers)
        for row in exported_rows(opts.targets)
        for half in ("lora_A", "lora_B")
    }
    with safe_open(str(out / ADAPTER_FILE), "pt") as f:
        have = set(f.keys())
    return sorted(want - have), sorted(have - want)


def float32_logits(run: Any) -> Any:
    """The trained adapter evaluated in float32 (collective): a float32 native model of the same base and layout
    with the adapter's values copied in (exact: every bf16 value is a float32 value). In bf16 the rounding of a
    whole forward is larger than the effect of one target's delta; in float32 it is far below it, so the reload
    check can see a lost target."""
    import torch

    import impl
    from impl.adapter.gather import native_adapter_name
    from impl.native.schedule import ManualPipeline

    opts = run.opts
    hook = impl.make_lora_pre_wrap_hook(targets=list(opts.targets), rank=opts.rank, alpha=opts.alpha)

    def load_base(chunks):
        impl.load_official_checkpoint(chunks, run.base)
        return chunks

    (twin,) = impl.build_native_model(
        run.hf_config, tp=opts.tp, ep=opts.ep, pp=opts.pp, pre_wrap_hooks=[load_base, hook], params_dtype=torch.float32
    )
    trained = {native_adapter_name(n): p for n, p in run.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if p.requires_grad:
                p.copy_(trained[native_adapter_name(n)])
        twin.eval()
        return ManualPipeline(twin).run(run.eval_ids, run.positions)


def check_reload(run: Any, out: Path) -> None:
    """``reload`` (rank 0): PEFT on transformers' model of the base gives the native LoRA model's logits, in
    float32 whatever the training dtype; the comparison counts only when removing any one target or any one
    layer from the reloaded adapter moves the logits by more than its tolerance."""
    import torch

    import impl
    from impl.adapter.dialects import DIALECTS, PEFT_PREFIX

    opts = run.opts
    run.progress.step("reload with PEFT on transformers and compare logits")
    t0 = time.perf_counter()
    if opts.dialect != "transformers" or not opts.oracle:
        why = "--no-oracle" if not opts.oracle else f"dialect {opts.dialect!r} (the reload uses 'transformers')"
        run.record("reload", None, f"skipped: {why}", t0)
        return
    rule = LOGIT_RULE
    lora_logits = run.lora_logits.cpu().float()
    ids = run.eval_ids.cpu()
    models = {
        "merged": impl.load_peft_adapter(base_model(run.base), out, merge=True).eval(),
        "unmerged": impl.load_peft_adapter(base_model(run.base), out, merge=False).eval(),  # grouped o_a_proj
    }
    with torch.no_grad():
        cmps = {mode: rule.compare(lora_logits, m(ids).logits.float()) for mode, m in models.items()}
        worst = max(cmps.values(), key=lambda c: c.observed / c.tolerance)
        moved = (lora_logits - run.oracle_logits).abs().max().item()
        dialect = DIALECTS[opts.dialect]

        def parse(name: str):
            hit = dialect.parse_module(name.removeprefix(PEFT_PREFIX))
            return None if hit is None else (hit[0], hit[1].native)

        power = adapter_effects(
            models["unmerged"], lambda: models["unmerged"](ids).logits.float(), parse, rule, worst.tolerance
        )
    part, effect = power.smallest
    passed = all(c.passed for c in cmps.values())
    verdict = "" if power.conclusive else f"INCONCLUSIVE: tolerance >= the effect of {part} ({effect:.1e}); "
    run.record(
        "reload",
        passed and power.conclusive,
        f"{verdict}{rule.metric}|Δ| merged {cmps['merged'].observed:.2e}, unmerged {cmps['unmerged'].observed:.2e} "
        f"(tol {worst.tolerance:.1e}, margin {worst.margin:.0f}, float32); smallest effect: {part} {effect:.1e}",
        t0,
        inconclusive=passed and not power.conclusive,
        max_abs_diff=worst.observed,
        max_abs_diff_merged=cmps["merged"].observed,
        max_abs_diff_unmerged=cmps["unmerged"].observed,
        adapter_effect=moved,
        trained_dtype=opts.dtype,
        eval_batch=ids.tolist(),
        **worst.detail(),
        **power.detail(),
        merged=cmps["merged"].detail(),
        unmerged=cmps["unmerged"].detail(),
    )
