"""``dsv4-lora qualify``: the whole DeepSeek-V4 LoRA contract, end to end, on one base.

Steps (each a :class:`Check` with a figure and pass/fail):

| check | what it proves |
|---|---|
| ``detect`` | the base is exactly ``DeepseekV4ForCausalLM`` |
| ``coverage`` | every checkpoint tensor maps through the table (0 unmapped, 0 missing) |
| ``build`` | native graph built by the provider, LoRA applied in a pre-wrap hook before DDP; only adapters train |
| ``strict_load`` | every native parameter and buffer filled from the checkpoint, nothing left over |
| ``base_logits`` | with zero-initialised adapters the native logits equal transformers' (max abs diff) |
| ``train`` | a few optimizer steps: finite loss, finite non-zero updates on every adapter, base bit-identical |
| ``export`` | adapter-only PEFT export, validated, ``.complete`` written last |
| ``reload`` | PEFT loads the adapter onto transformers' model of the same base; logits equal the native LoRA model's |
| ``verify`` | the exported directory passes ``verify-adapter`` checks (files, marker, fingerprint) |
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from impl.lora.vocabulary import TARGET_TABLE, TargetRow

TOLERANCE = 1e-5


@dataclass(frozen=True)
class LogitCheck:
    """How native logits are compared with transformers' fp32 logits in one parameter dtype."""

    dtype: str  # a torch dtype name
    metric: str  # "max" or "mean" absolute difference
    tolerance: float


#: bf16: the mean tolerance of suites/test_bf16.py (routing flips under bf16 rounding move single tokens far)
LOGIT_CHECKS = {c.dtype: c for c in (LogitCheck("float32", "max", TOLERANCE), LogitCheck("bfloat16", "mean", 0.1))}
DEFAULT_TARGETS = TARGET_TABLE.main_names


@dataclass(frozen=True)
class QualifyOptions:
    base: str
    out: str
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rank: int = 8
    alpha: float = 16.0
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dialect: str = "transformers"
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    batch: int = 2
    seq_len: int | None = None
    timeout_s: float = 900.0
    oracle: bool = True  # compare with transformers (tiny bases; a full-size oracle does not fit one host)
    dtype: str = "float32"  # parameter dtype, a LOGIT_CHECKS key


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not applicable in this configuration
    figure: str
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def _logit_error(got, want, check: LogitCheck) -> float:
    diff = (got.cpu().float() - want.cpu().float()).abs()
    return float(diff.max() if check.metric == "max" else diff.mean())


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy()).hexdigest()


class _Progress:
    def __init__(self, rank: int, total: int):
        self.rank, self.total, self.i, self.t = rank, total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.i += 1
        if self.rank == 0:
            print(f"  [{self.i}/{self.total}] {what} ...", flush=True)


@dataclass
class _RankRun:
    """What one qualify rank carries from step to step; each step records its :class:`Check`."""

    rank: int
    opts: QualifyOptions
    base: Path
    hf_config: Any
    progress: _Progress
    checks: list[Check] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)
    handle: Any = None
    eval_ids: Any = None
    positions: Any = None
    generator: Any = None
    seq: int = 0
    oracle_logits: Any = None  # rank 0, with the oracle: transformers' logits of the base
    lora_logits: Any = None  # the native model's logits after training

    def record(self, name: str, passed: bool | None, figure: str, t0: float, **detail: Any) -> None:
        self.checks.append(Check(name, passed, figure, detail, round(time.perf_counter() - t0, 3)))

    @property
    def model(self) -> Any:
        return self.chunks[0].module


def _init_parallel(opts: QualifyOptions) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        expert_model_parallel_size=opts.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=max(1.0, opts.timeout_s / 120),
    )
    model_parallel_cuda_manual_seed(opts.seed + 1)


def _build(run: _RankRun) -> None:
    """``build`` and ``strict_load``: provider build, base load and LoRA in pre-wrap hooks, then DDP."""
    import torch

    import impl

    opts = run.opts
    run.progress.step("build native model (strict load + LoRA pre-wrap hooks, then DDP)")
    t0 = time.perf_counter()
    loaded: dict[str, Any] = {}

    def load_base(chunks):
        loaded["report"] = impl.load_official_checkpoint(chunks, run.base)
        return chunks

    lora_hook = impl.make_lora_pre_wrap_hook(targets=list(opts.targets), rank=opts.rank, alpha=opts.alpha)
    run.chunks = impl.build_native_model(
        run.hf_config,
        tp=opts.tp,
        ep=opts.ep,
        pp=opts.pp,
        pre_wrap_hooks=[load_base, lora_hook],
        wrap_with_ddp=True,
        params_dtype=getattr(torch, opts.dtype),
    )
    (chunk,) = run.chunks
    model = chunk.module
    handle = run.handle = lora_hook.handle
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    saved = set(handle.params_to_save)
    buffered = {id(p) for buf in [*chunk.buffers, *chunk.expert_parallel_buffers] for p in buf.params}
    ddp_names = {n for n, p in model.named_parameters() if id(p) in buffered}
    adapters_only = bool(trainable) and all(".adapter." in n for n in trainable)
    run.record(
        "build",
        adapters_only and ddp_names == trainable and trainable <= {n.removeprefix("module.") for n in saved},
        f"{sum(len(w) for w in handle.wrapped)} modules wrapped, {len(trainable)} trainable tensors, DDP after hook",
        t0,
        wrapped=handle.wrapped,
        trainable=len(trainable),
        ddp_buffer_params=len(ddp_names),
    )
    report = loaded["report"]
    totals = report.totals
    run.record(
        "strict_load",
        totals["unmapped"] == 0 and totals["missing"] == 0 and totals["native_filled"] > 0,
        f"loaded {totals['loaded']}, declared-not-loaded {totals['declared_not_loaded']}, "
        f"unmapped {totals['unmapped']}, missing {totals['missing']}",
        t0,
        totals=totals,
        declared=dict(report.declared_not_loaded),
    )


def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _logits(run: _RankRun) -> Any:
    import torch

    from impl.native.schedule import ManualPipeline

    run.model.eval()
    with torch.no_grad():
        return ManualPipeline(run.chunks[0]).run(run.eval_ids, run.positions)


def _check_base_logits(run: _RankRun) -> None:
    """``base_logits``: zero-initialised adapters leave transformers' logits unchanged (rank 0 compares)."""
    import torch

    from impl.native.config import V4Config

    opts = run.opts
    run.seq = opts.seq_len or V4Config.from_hf(run.hf_config).min_seq_len
    run.generator = torch.Generator().manual_seed(opts.seed)
    device = _device()
    run.eval_ids = torch.randint(0, run.hf_config.vocab_size, (opts.batch, run.seq), generator=run.generator)
    run.eval_ids = run.eval_ids.to(device)
    run.positions = torch.arange(run.seq, device=device).unsqueeze(0)
    run.progress.step("base logits vs transformers (zero-initialised adapters)")
    t0 = time.perf_counter()
    native = _logits(run)
    if run.rank == 0 and opts.oracle:
        from tiny_models.checkpoint import load_oracle

        with torch.no_grad():
            run.oracle_logits = load_oracle(run.base)(run.eval_ids.cpu()).logits.float()
        check = LOGIT_CHECKS[opts.dtype]
        diff = _logit_error(native, run.oracle_logits, check)
        figure = f"{check.metric}|Δ|={diff:.2e} (tol {check.tolerance:g}, {check.dtype})"
        run.record("base_logits", diff <= check.tolerance, figure, t0, max_abs_diff=diff)
    elif run.rank == 0:
        run.record("base_logits", None, "skipped (--no-oracle)", t0)


def _train(run: _RankRun) -> None:
    """``train``: finite loss, a finite non-zero update on every adapter, the base bit-identical."""
    import torch

    import impl

    opts = run.opts
    run.progress.step(f"train {opts.steps} steps")
    t0 = time.perf_counter()
    model = run.model
    base_before = {n: _sha(p) for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.Adam(adapters.values(), lr=opts.lr)
    losses = []
    for _ in range(opts.steps):
        ids = torch.randint(0, run.hf_config.vocab_size, (opts.batch, run.seq), generator=run.generator)
        losses.append(impl.adapter_train_step(run.chunks, ids.to(_device()), opt, position_ids=run.positions))
    no_update = [n for n, p in adapters.items() if torch.equal(p.detach(), before[n])]
    non_finite = [n for n, p in adapters.items() if not torch.isfinite(p).all()]
    base_changed = [n for n, p in model.named_parameters() if not p.requires_grad and _sha(p) != base_before[n]]
    finite = all(torch.isfinite(torch.tensor(losses)))
    run.record(
        "train",
        finite and not no_update and not non_finite and not base_changed,
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {len(adapters) - len(no_update)}/{len(adapters)} adapters "
        f"updated; {len(base_changed)} base tensors changed",
        t0,
        losses=losses,
        not_updated=no_update,
        non_finite=non_finite,
        base_changed=base_changed,
    )
    run.lora_logits = _logits(run)


def _export(run: _RankRun) -> Path:
    """``export`` (collective): gather the adapter, publish it with the base's fingerprint."""
    import impl
    from impl.adapter.dialects import official_base_name
    from impl.adapter.gather import gather_adapter_state

    opts = run.opts
    run.progress.step("export adapter (gather, stage, validate, publish, .complete)")
    t0 = time.perf_counter()
    out = Path(opts.out) / "adapter"
    layers = range(run.hf_config.num_hidden_layers)
    fp_names = [official_base_name(n, row) for n in layers for row in _exported_rows(opts.targets)]
    fingerprint = impl.base_fingerprint(run.base, fp_names)
    state = gather_adapter_state(run.chunks, run.handle)
    impl.export_adapter(
        lambda: state,
        out,
        dialect=opts.dialect,
        base_model_name_or_path=str(run.base),
        base_fingerprint=fingerprint,
        timeout_s=opts.timeout_s / 4,
    )
    if run.rank == 0:
        files = sorted(p.name for p in out.iterdir())
        run.record("export", (out / impl.COMPLETE_MARKER).exists(), f"{len(files)} files: {', '.join(files)}", t0)
    return out


def _check_reload(run: _RankRun, out: Path) -> None:
    """``reload`` (rank 0): PEFT on transformers' model of the base gives the native LoRA model's logits."""
    import torch

    import impl

    opts = run.opts
    run.progress.step("reload with PEFT on transformers and compare logits")
    t0 = time.perf_counter()
    if opts.dialect != "transformers" or not opts.oracle:
        why = "--no-oracle" if not opts.oracle else f"dialect {opts.dialect!r} (the reload uses 'transformers')"
        run.record("reload", None, f"skipped: {why}", t0)
        return
    from tiny_models.checkpoint import load_oracle

    check = LOGIT_CHECKS[opts.dtype]
    lora_logits = run.lora_logits.cpu()
    diffs = {}
    for mode, merge in (("merged", True), ("unmerged", False)):  # unmerged: grouped o_a_proj layer
        peft_model = impl.load_peft_adapter(load_oracle(run.base), out, merge=merge).eval()
        with torch.no_grad():
            reloaded = peft_model(run.eval_ids.cpu()).logits.float()
        diffs[mode] = _logit_error(lora_logits, reloaded, check)
    diff = max(diffs.values())
    moved = (lora_logits.float() - run.oracle_logits).abs().max().item()
    run.record(
        "reload",
        diff <= check.tolerance and moved > 0,
        f"{check.metric}|Δ| merged {diffs['merged']:.2e}, unmerged {diffs['unmerged']:.2e} "
        f"(tol {check.tolerance:g}); adapter moved logits by {moved:.2e}",
        t0,
        max_abs_diff=diff,
        max_abs_diff_merged=diffs["merged"],
        max_abs_diff_unmerged=diffs["unmerged"],
        adapter_effect=moved,
    )


def _check_verify(run: _RankRun, out: Path) -> None:
    """``verify`` (rank 0): the published directory passes the ``verify-adapter`` checks."""
    import impl

    run.progress.step("verify the published adapter against its base")
    t0 = time.perf_counter()
    try:
        impl.validate_adapter_dir(out, base=run.base)
        impl.verify_fingerprint(out, run.base)
        run.record("verify", True, "files, marker hashes, names, shapes, finiteness, fingerprint", t0)
    except impl.Dsv4Error as exc:
        run.record("verify", False, f"{type(exc).__name__}: {exc}", t0)


def _qualify_rank(rank: int, world: int, opts: QualifyOptions) -> dict[str, Any]:
    """One rank's share of qualify: every step in order; rank 0 also checks against the oracle and the export."""
    from transformers import AutoConfig

    _init_parallel(opts)
    base = Path(opts.base)
    run = _RankRun(rank, opts, base, AutoConfig.from_pretrained(base), _Progress(rank, 6))
    _build(run)
    _check_base_logits(run)
    _train(run)
    out = _export(run)
    if rank == 0:
        _check_reload(run, out)
        _check_verify(run, out)
    return {"rank": rank, "checks": [asdict(c) for c in run.checks]}


def _exported_rows(targets) -> list[TargetRow]:
    """The table rows of the exportable (main-attention) targets among ``targets`` (any accepted name), once each."""
    rows = (TARGET_TABLE.row(t) for t in targets)
    return list(dict.fromkeys(row for row in rows if row is not None and row.main))


def _preload() -> None:
    """Import what a rank uses before the launcher starts its clock (``import impl`` alone is lazy)."""
    import impl

    for name in ("build_native_model", "load_official_checkpoint", "make_lora_pre_wrap_hook", "adapter_train_step"):
        getattr(impl, name)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors", "dsv4-lora"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def run_qualify(opts: QualifyOptions, *, nproc: int) -> list[Check]:
    """Every check, in order (host-side checks first, then rank 0's)."""
    from impl.cli.launch import run_on_ranks
    from impl.conversion.base_dir import inspect_base
    from impl.conversion.coverage import coverage_report
    from impl.conversion.detect import is_deepseek_v4_config

    checks: list[Check] = []
    base = Path(opts.base)
    t0 = time.perf_counter()
    read = inspect_base(
        base, transformers_config=True
    )  # headers only: a bad base is named here, before any rank starts
    problems = [p.message for p in read.problems]
    if read.config is None or not is_deepseek_v4_config(read.config):
        checks.append(Check("detect", False, problems[0], {"problems": problems}, 0.0))
        return checks
    checks.append(Check("detect", True, f"architectures[0]={read.config['architectures'][0]}", {}, 0.0))
    if problems:
        checks.append(Check("base", False, "; ".join(problems), {"problems": problems}, 0.0))
        return checks
    cov = coverage_report(base)
    tot = cov.totals
    checks.append(
        Check(
            "coverage",
            tot.get("unmapped", 0) == 0 and tot.get("missing", 0) == 0,
            ", ".join(f"{k} {v}" for k, v in tot.items())
            + "".join(
                f"; {kind}: {', '.join(names[:5])}"
                for kind, names in (("unmapped", cov.unmapped), ("missing", cov.missing))
                if names
            ),
            {"totals": tot, "unmapped": cov.unmapped[:20], "missing": cov.missing[:20]},
            round(time.perf_counter() - t0, 3),
        )
    )
    if not checks[-1].passed:
        return checks
    payloads = run_on_ranks(_qualify_rank, opts, nproc=nproc, timeout_s=opts.timeout_s, preload=(_preload,))
    checks += [Check(**c) for c in payloads[0]["checks"]]
    for p in payloads[1:]:  # other ranks report only what failed locally
        checks += [
            Check(**{**c, "name": f"{c['name']}[rank {p['rank']}]"}) for c in p["checks"] if c["passed"] is False
        ]
    return checks
