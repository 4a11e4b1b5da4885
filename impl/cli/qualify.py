"""``dsv4-lora qualify``: the whole DeepSeek-V4 LoRA contract, end to end, on one base.

This module is the launcher's side: options, the base's header checks, the ranks started and their checks gathered;
:mod:`impl.cli.qualify_rank` is the rank's. The launcher must import neither torch nor transformers nor megatron, so
it starts fast; the ranks import them. Rank 0 sends one progress line per step through the launcher
(:mod:`impl.cli.output`). The checks and what each proves: :func:`run_qualify`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from impl.cli import output
from impl.cli.qualify_checks import Check, QualifyOptions, all_passed, header_checks

__all__ = [
    "run_qualify",
]

#: the progress lines of a run: starting the ranks (the launcher), then seven steps on rank 0
STEP_COUNT = 8


@dataclass(frozen=True)
class DefaultBase:
    """The embedded default base, a deterministic tiny V4 checkpoint: rank 0 writes it while the ranks start up
    (the ranks import transformers anyway; the launcher then never does)."""

    preset: str
    seed: int
    path: str

    def __call__(self) -> None:
        from dsv4_launcher.launch import launched_world

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


def run_qualify(opts: QualifyOptions, *, nproc: int, default_base: DefaultBase | None = None) -> list[Check]:
    """Every check, in order (rank 0's, and what failed on other ranks). ``default_base``: rank 0 writes the
    embedded base into ``opts.base`` while the ranks start up.

    Each step is a :class:`Check` with a figure and pass/fail:

    | check | what it proves |
    |---|---|
    | ``detect`` | the base is exactly ``DeepseekV4ForCausalLM`` |
    | ``coverage`` | every checkpoint tensor maps through the table (0 unmapped, 0 missing) |
    | ``build`` | native graph built by the provider, LoRA applied in a pre-wrap hook before DDP; only adapters train |
    | ``strict_load`` | every native parameter and buffer filled from the checkpoint, nothing left over |
    | ``base_logits`` | with zero-initialised adapters the native logits equal transformers' (the judge's |
    |                 | rule for the dtype) |
    | ``train`` | optimizer steps on ONE fixed batch: the loss falls, finite non-zero updates on every adapter, base |
    |           | unchanged |
    | ``export`` | adapter-only PEFT export, validated, ``.complete`` written last; its tensors exactly the requested |
    |            | targets x layers |
    | ``reload`` | PEFT loads the adapter onto transformers' model of the same base; logits equal the native LoRA |
    |            | model's, in float32 (the judge's rule); inconclusive unless removing any one target or layer |
    |            | moves them more |
    | ``verify`` | the exported directory passes ``verify-adapter`` checks (files, marker, fingerprint) |

    The launcher prints the start line with its time when every rank is ready (rank 0 writes the embedded default
    base meanwhile); each rank then runs every check, ``detect`` and ``coverage`` first, and rank 0 sends one
    progress line per step, with its time.
    """
    from dsv4_launcher.launch import run_on_ranks
    from dsv4_lora.qualify_driver import rank_thread_env
    from impl.cli.qualify_rank import preload, qualify_rank
    from impl.conversion.base_dir import inspect_base

    if default_base is None:  # a given base: name what is wrong with it before any rank starts (headers only)
        checks = header_checks(inspect_base(opts.base))
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
        env=rank_thread_env(),
    )
    checks = [Check(**c) for c in payloads[0]["checks"]]
    for p in payloads[1:]:  # other ranks report only what failed locally
        checks += [
            Check(**{**c, "name": f"{c['name']}[rank {p['rank']}]"}) for c in p["checks"] if c["passed"] is False
        ]
    return checks
