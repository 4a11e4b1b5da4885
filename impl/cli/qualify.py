"""``dsv4-lora qualify``: the whole DeepSeek-V4 LoRA contract, end to end, on one base.

Steps (each a :class:`Check` with a figure and pass/fail):

| check | what it proves |
|---|---|
| ``detect`` | the base is exactly ``DeepseekV4ForCausalLM`` |
| ``coverage`` | every checkpoint tensor maps through the table (0 unmapped, 0 missing) |
| ``build`` | native graph built by the provider, LoRA applied in a pre-wrap hook before DDP; only adapters train |
| ``strict_load`` | every native parameter and buffer filled from the checkpoint, nothing left over |
| ``base_logits`` | with zero-initialised adapters the native logits equal transformers' (within :class:`LogitCheck`) |
| ``train`` | optimizer steps on ONE fixed batch: the loss falls, finite non-zero updates on every adapter, base unchanged |
| ``export`` | adapter-only PEFT export, validated, ``.complete`` written last; its tensors exactly the requested |
|            | targets x layers |
| ``reload`` | PEFT loads the adapter onto transformers' model of the same base; logits equal the native LoRA model's, in |
|            | float32 (:mod:`impl.cli.logits`); inconclusive unless removing any one target or layer moves them more |
| ``verify`` | the exported directory passes ``verify-adapter`` checks (files, marker, fingerprint) |

This module is the launcher's side (options, the base's header checks, the ranks started and their checks
gathered); :mod:`impl.cli.qualify_rank` is the rank's. Where the time goes: the launcher imports neither torch nor
transformers nor megatron. It starts the ranks, which
import them (and rank 0 writes the embedded default base meanwhile), and prints the start line with its time when
every rank is ready; each rank then runs every check, ``detect`` and ``coverage`` first, and rank 0 sends one
progress line per step, with its time, through the launcher (:mod:`impl.cli.output`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.cli import output
from impl.lora.vocabulary import TARGET_TABLE

__all__ = [
    "QualifyOptions",
    "run_qualify",
]

#: the progress lines of a run: starting the ranks (the launcher), then seven steps on rank 0
STEP_COUNT = 8
#: intra-op threads per rank unless OMP_NUM_THREADS is set: a tiny model's ops gain nothing from more, and on a
#: shared host OpenMP's barriers wait for descheduled threads (docs/performance.md)
RANK_THREADS = 1


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
    inconclusive: bool = False  # not passed: the comparison could not have seen the defects it claims to catch


@dataclass(frozen=True)
class DefaultBase:
    """The embedded default base, a deterministic tiny V4 checkpoint: rank 0 writes it while the ranks start up
    (the ranks import transformers anyway; the launcher then never does)."""

    preset: str
    seed: int
    path: str

    def __call__(self) -> None:
        from launcher.launch import launched_world

        world = launched_world()
        if world is None or world.rank == 0:
            from tiny_models.oracle import write_checkpoint

            write_checkpoint(self.preset, self.path, seed=self.seed)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors", "dsv4-lora"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def all_passed(checks: list[Check]) -> bool:
    return all(c.passed for c in checks)


def _header_checks(read: Any) -> list[Check]:
    """``detect`` (and ``base`` when the directory has problems) from :func:`inspect_base`'s headers-only read."""
    from impl.conversion.detect import is_deepseek_v4_config

    problems = [p.message for p in read.problems]
    if read.config is None or not is_deepseek_v4_config(read.config):
        return [Check("detect", False, problems[0], {"problems": problems}, 0.0)]
    checks = [Check("detect", True, f"architectures[0]={read.config['architectures'][0]}", {}, 0.0)]
    if problems:
        checks.append(Check("base", False, "; ".join(problems), {"problems": problems}, 0.0))
    return checks


def base_checks(base: Path) -> list[Check]:
    """``detect`` and ``coverage``: the config and the safetensors headers (every rank: cheap, and every rank must
    know to stop)."""
    from impl.conversion.base_dir import inspect_base
    from impl.conversion.coverage import coverage_report
    from impl.errors import Dsv4Error

    t0 = time.perf_counter()
    checks = _header_checks(inspect_base(base, transformers_config=True))
    if not all_passed(checks):
        return checks
    try:
        cov = coverage_report(base)
    except Dsv4Error as exc:  # e.g. a corrupt safetensors file: the check fails with the problem, no traceback
        return [*checks, Check("coverage", False, str(exc), {}, round(time.perf_counter() - t0, 3))]
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
            )
            + (f"; {cov.base_layout} layout (save_pretrained), no MTP" if cov.base_layout != "official" else ""),
            {
                "totals": tot,
                "unmapped": cov.unmapped[:20],
                "missing": cov.missing[:20],
                "base_layout": str(cov.base_layout),
            },
            round(time.perf_counter() - t0, 3),
        )
    )
    return checks


def run_qualify(opts: QualifyOptions, *, nproc: int, default_base: DefaultBase | None = None) -> list[Check]:
    """Every check, in order (rank 0's, and what failed on other ranks). ``default_base``: rank 0 writes the
    embedded base into ``opts.base`` while the ranks start up."""
    from impl.cli.qualify_rank import preload, qualify_rank
    from impl.conversion.base_dir import inspect_base
    from launcher.launch import run_on_ranks

    if default_base is None:  # a given base: name what is wrong with it before any rank starts (headers only)
        checks = _header_checks(inspect_base(opts.base))
        if not all_passed(checks):
            return checks
    output.declare_steps(STEP_COUNT)
    t0 = time.perf_counter()
    written = ", write the default base" if default_base is not None else ""
    started = f"start {nproc} rank{'s' * (nproc > 1)} (import torch, Megatron-Core/Bridge, transformers{written})"
    preloads = (preload,) if default_base is None else (preload, default_base)
    payloads = run_on_ranks(
        qualify_rank,
        opts,
        nproc=nproc,
        timeout_s=opts.timeout_s,
        preload=preloads,
        before_go=lambda: output.step(started, time.perf_counter() - t0),
        env={} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(RANK_THREADS)},
    )
    checks = [Check(**c) for c in payloads[0]["checks"]]
    for p in payloads[1:]:  # other ranks report only what failed locally
        checks += [
            Check(**{**c, "name": f"{c['name']}[rank {p['rank']}]"}) for c in p["checks"] if c["passed"] is False
        ]
    return checks
