"""The rank's side of ``dsv4-lora qualify``: each rank builds the native model, loads the base, runs the checks
(:mod:`impl.cli.qualify` lists them) and returns them to the launcher; rank 0 exports, reloads and verifies, and
sends one progress line per step through the launcher (:mod:`impl.cli.output`). Imported only on the ranks."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsv4_conformance.judge.oracle import LOGIT_RULES, base_model
from impl.cli import output
from impl.cli.qualify_adapter import check_reload, export, float32_logits
from impl.cli.qualify_checks import Check, QualifyOptions, all_passed, base_checks


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8).numpy()).hexdigest()


class _Progress:
    """Rank 0's step lines: a step's line, with its time, goes out when the next step begins or at :meth:`finish`."""

    def __init__(self, rank: int):
        self.rank, self.what, self.t = rank, "", 0.0

    def step(self, what: str) -> None:
        self.finish()
        self.what, self.t = what, time.perf_counter()

    def finish(self) -> None:
        if self.what and self.rank == 0:
            output.step(self.what, time.perf_counter() - self.t)
        self.what = ""


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

    def record(
        self, name: str, passed: bool | None, figure: str, t0: float, inconclusive: bool = False, **detail: Any
    ) -> None:
        seconds = round(time.perf_counter() - t0, 3)
        self.checks.append(Check(name, passed, figure, detail, seconds, inconclusive))

    @property
    def model(self) -> Any:
        return self.chunks[0].module


def _init_parallel(opts: QualifyOptions) -> None:
    import impl.compat.active  # noqa: F401  (the rank's side: the CPU compat layer before megatron)

    # isort: split
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
        with torch.no_grad():
            run.oracle_logits = base_model(run.base)(run.eval_ids.cpu()).logits.float()
        rule = LOGIT_RULES[opts.dtype]
        cmp = rule.compare(native, run.oracle_logits)
        figure = f"{rule.metric}|Δ|={cmp.observed:.2e} (tol {cmp.tolerance:.1e}, margin {cmp.margin:.0f}, {rule.dtype})"
        run.record("base_logits", cmp.passed, figure, t0, max_abs_diff=cmp.observed, **cmp.detail())
    elif run.rank == 0:
        run.record("base_logits", None, "skipped (--no-oracle)", t0)


def _train(run: _RankRun) -> None:
    """``train``: ``steps`` optimizer steps on one batch drawn once; the loss on that batch must fall (its last figure
    is taken after the last step), every adapter gets a finite non-zero update, the base stays bit-identical.

    A fresh batch per step would make the losses incomparable (each batch has its own loss), so a rise would
    say nothing and a fall could be luck; on a fixed batch a fall shows the gradients point downhill."""
    import torch

    import impl

    opts = run.opts
    run.progress.step(f"train {opts.steps} steps on one fixed batch")
    t0 = time.perf_counter()
    model = run.model
    base_before = {n: _sha(p) for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.Adam(adapters.values(), lr=opts.lr)
    ids = torch.randint(0, run.hf_config.vocab_size, (opts.batch, run.seq), generator=run.generator).to(_device())
    losses = [impl.adapter_train_step(run.chunks, ids, opt, position_ids=run.positions) for _ in range(opts.steps)]
    losses.append(_batch_loss(run, ids))
    no_update = [n for n, p in adapters.items() if torch.equal(p.detach(), before[n])]
    non_finite = [n for n, p in adapters.items() if not torch.isfinite(p).all()]
    base_changed = [n for n, p in model.named_parameters() if not p.requires_grad and _sha(p) != base_before[n]]
    finite = all(torch.isfinite(torch.tensor(losses)))
    fell = finite and losses[-1] < losses[0]
    run.record(
        "train",
        fell and not no_update and not non_finite and not base_changed,
        f"loss on the fixed batch {losses[0]:.4f} -> {losses[-1]:.4f} ({'fell' if fell else 'DID NOT FALL'}); "
        f"{len(adapters) - len(no_update)}/{len(adapters)} adapters updated; {len(base_changed)} base tensors changed",
        t0,
        losses=losses,
        first_loss=losses[0],
        last_loss=losses[-1],
        loss_fell=fell,
        batch=ids.cpu().tolist(),  # the fixed batch, so anyone can recompute both losses
        not_updated=no_update,
        non_finite=non_finite,
        base_changed=base_changed,
    )
    run.lora_logits = _logits(run)


def _batch_loss(run: _RankRun, ids: Any) -> float:
    """The mean token loss on ``ids`` (next-token labels, as the train step uses) with the adapters as they are."""
    import torch

    from impl.native.schedule import ManualPipeline

    run.model.eval()
    with torch.no_grad():
        loss = ManualPipeline(run.chunks[0]).run(ids, run.positions, labels=torch.roll(ids, -1, dims=1))
    return float(loss.float().mean())


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


def qualify_rank(rank: int, world: int, opts: QualifyOptions) -> dict[str, Any]:
    """One rank's share of qualify: every step in order; rank 0 also checks against the oracle and the export."""
    from transformers import AutoConfig

    base = Path(opts.base)
    progress = _Progress(rank)
    progress.step("detect and coverage (config.json, safetensors headers)")
    checks = base_checks(base)
    if not all_passed(checks):  # every rank sees the same base: all stop here
        progress.finish()
        return {"rank": rank, "checks": [asdict(c) for c in checks] if rank == 0 else []}
    _init_parallel(opts)
    run = _RankRun(rank, opts, base, AutoConfig.from_pretrained(base), progress, checks)
    _build(run)
    _check_base_logits(run)
    _train(run)
    out = export(run)
    if opts.dtype != "float32" and opts.oracle and opts.dialect == "transformers":
        run.lora_logits = float32_logits(run)
    if rank == 0:
        check_reload(run, out)
        _check_verify(run, out)
    run.progress.finish()
    return {"rank": rank, "checks": [asdict(c) for c in run.checks]}


def preload() -> None:
    """Import what a rank uses before the launcher starts its clock (``import impl`` alone is lazy), so the
    step lines time the work and the start line the imports."""
    from transformers import AutoConfig  # noqa: F401

    import impl
    from dsv4_conformance.judge.oracle import base_model  # noqa: F401

    for name in (
        "build_native_model",
        "load_official_checkpoint",
        "make_lora_pre_wrap_hook",
        "adapter_train_step",
        "load_peft_adapter",
    ):
        getattr(impl, name)
