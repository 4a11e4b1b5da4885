"""``dsv4-lora qualify --driver MODULE``: the contract on one base, for any implementation, through its driver alone.

The ranks (:mod:`dsv4_lora.qualify_driver_rank`) call the driver and return what it gave; this side judges it with
the conformance judge, the suites' own rules, on one layout in one run:

| check | passes when |
|---|---|
| ``detect`` | the driver recognises the base, and not the same config under ``DeepseekV3ForCausalLM`` |
| ``targets`` | each target reaches its projection in every layer's main attention and nothing else (an MTP block's own main attention may be wrapped too) |
| ``load`` | the base loads strictly: tensors placed, none missing, none unexpected |
| ``base_logits`` | the base's logits equal transformers' within the judge's rule, held below one layer's effect |
| ``train`` | every loss is finite and the last is below the first (SGD on one fixed batch); with the oracle, the judge's own loss of the exported adapter is below the base's, and the first loss is transformers' on that batch (where the dtype's rule bounds it and another batch would show) |
| ``export`` | the directory is a PEFT adapter of exactly the requested targets, rank and alpha, with the declared success marker; in another dialect (``--dialect``), in that dialect's names, judged as transformers' |
| ``reload`` | PEFT's reload on transformers gives the trained logits (a run in another dtype: a float32 build that imported the export) within the judge's rule; inconclusive unless the least module's delta moves them more |
"""

from __future__ import annotations

import importlib
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import Driver, Layout, LoraSpec, load_driver
from dsv4_conformance.judge.oracle import fixed_batch
from dsv4_lora.qualify_driver_rank import STEPS, DriverRun, qualify_driver_rank

__all__ = ["STEP_COUNT", "Check", "DefaultBase", "DriverRun", "find_driver", "judge_run", "qualify_driver", "versions"]

#: the progress lines of a run: the ranks' start, each rank step, then the judge
STEP_COUNT = len(STEPS) + 2


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not judged (``--no-oracle``)
    figure: str
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    inconclusive: bool = False  # not passed: the comparison could not have seen the defect it claims to catch


@dataclass
class _Judging:
    """One run under judgement: transformers' model of the base and the fixed batch, each made once, when a check
    first needs it."""

    run: DriverRun
    marker: str | None
    with_oracle: bool = True
    scratch: Path | None = None  # where an export in another dialect is written in transformers' dialect

    @cached_property
    def reading(self) -> Any:
        """An export in another dialect read as transformers' (None for a transformers export): what the comparisons
        reload, in ``scratch``."""
        from dsv4_conformance.judge.dialects import write_as_transformers

        if self.run.dialect == "transformers":
            return None
        return write_as_transformers(Path(self.run.adapter_dir), self.run.dialect, self.scratch / "as-transformers")

    @property
    def adapter(self) -> Path:
        """The export in transformers' dialect: what PEFT reloads."""
        return Path(self.run.adapter_dir) if self.reading is None else self.scratch / "as-transformers"

    @cached_property
    def oracle(self) -> Any:
        from dsv4_conformance.judge.oracle import base_model

        return base_model(Path(self.run.base))

    @cached_property
    def batch(self) -> Any:
        return fixed_batch(self.run.base, self.run.seed)

    @property
    def ids(self) -> Any:
        return self.batch[0]

    @cached_property
    def base_logits(self) -> Any:
        """transformers' logits of the base on the fixed batch."""
        import torch

        with torch.no_grad():
            return self.oracle(self.ids).logits.float()

    @cached_property
    def trained_logits(self) -> Any:
        """PEFT's reload of the export on transformers, on the fixed batch, merged: stock PEFT's unmerged forward
        fails on the grouped ``o_a_proj`` (a shape mismatch), which only a custom LoRA layer can wrap."""
        from dsv4_conformance.judge.oracle import peft_logits

        return peft_logits(Path(self.run.base), self.adapter, self.ids)


def _detect(found: dict[str, Any], j: _Judging) -> Check:
    yes, lookalike = found["recognised"], found["recognised_lookalike"]
    figure = f"recognises the base: {yes}; recognises it named DeepseekV3ForCausalLM: {lookalike}"
    return Check("detect", yes and not lookalike, figure)


def _targets(found: dict[str, Any], j: _Judging) -> Check:
    config = json.loads((Path(j.run.base) / "config.json").read_text())
    targets = j.run.lora.targets
    meant = {f"layers.{i}.attn.{t}" for i in range(config["num_hidden_layers"]) for t in targets}
    got = set(found["modules"])

    def mtp_main(module: str) -> bool:
        parts = module.split(".")
        return parts[0] == "mtp" and parts[-2:-1] == ["attn"] and parts[-1] in targets

    missing, extra = sorted(meant - got), sorted(m for m in got - meant if not mtp_main(m))
    figure = f"{len(got)} modules for {','.join(targets)}"
    if missing or extra:
        figure += (
            f"; missing {missing[:3]}{'...' * (len(missing) > 3)}, not meant {extra[:3]}{'...' * (len(extra) > 3)}"
        )
    return Check("targets", not missing and not extra, figure, {"missing": missing, "not_meant": extra})


def _load(found: dict[str, Any], j: _Judging) -> Check:
    load = found["load"]
    clean = load["loaded"] > 0 and not load["missing"] and not load["unexpected"]
    figure = f"{load['loaded']} tensors placed, {len(load['missing'])} missing, {len(load['unexpected'])} unexpected"
    for kind in ("missing", "unexpected"):
        figure += f"; {kind} e.g. {load[kind][0]}" if load[kind] else ""
    return Check("load", clean, figure, load)


def _compared(name: str, got: Any, want: Any, rule: Any, power: Any) -> Check:
    """``got`` against the reference ``want`` under ``rule``; inconclusive unless ``power``'s effect exceeds the
    tolerance (the least defect the comparison claims to see)."""
    import torch

    if got is None:
        return Check(name, False, "rank 0 returned no logits")
    comparison = rule.compare(torch.from_numpy(got), want)
    conclusive = power.exceeds(comparison.tolerance)
    detail = {**comparison.detail(), "least_effect": power.effect, "least_effect_of": power.module}
    figure = (
        f"{rule.metric}|Δ| {comparison.observed:.2e} <= {comparison.tolerance:.2e}"
        if comparison.passed
        else f"{rule.metric}|Δ| {comparison.observed:.2e} > {comparison.tolerance:.2e}"
    ) + f"; least effect {power.effect:.2e} ({power.module})"
    return Check(
        name, comparison.passed and conclusive, figure, detail, inconclusive=comparison.passed and not conclusive
    )


def _base_logits(found: dict[str, Any], j: _Judging) -> Check:
    from dsv4_conformance.judge.oracle import LOGIT_RULES, least_layer_effect

    rule = LOGIT_RULES[j.run.layout.dtype]
    return _compared(
        "base_logits", found["base_logits"], j.base_logits, rule, least_layer_effect(j.oracle, j.ids, rule)
    )


def _loss(logits: Any, labels: Any) -> float:
    """The contract's loss: the mean over every position of the cross entropy against ``labels``."""
    import torch

    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def _train(found: dict[str, Any], j: _Judging) -> Check:
    losses = found["losses"]
    finite = all(math.isfinite(x) for x in losses)
    falls = len(losses) >= 2 and losses[-1] < losses[0]
    figure = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps" if losses else "no step"
    detail = {"losses": losses, "batch": j.ids.tolist(), "loss_fell": falls}
    detail.update({"first_loss": losses[0], "last_loss": losses[-1]} if losses else {})
    check = Check("train", finite and falls, figure, detail)
    if j.with_oracle and check.passed:
        _judge_the_training(check, j)
    return check


def _judge_the_training(check: Check, j: _Judging) -> None:
    """The judge's own losses: the export's (PEFT on transformers) must be below the base's, so reported losses alone
    never pass; and the first reported loss must be transformers' on the fixed batch (else it trained on another),
    where the dtype's rule bounds the largest logit difference (a loss moves by at most twice that) and another
    batch's loss differs by more than that."""
    import torch

    from dsv4_conformance.judge.oracle import LOGIT_RULES

    base_loss, trained_loss = _loss(j.base_logits, j.batch[1]), _loss(j.trained_logits, j.batch[1])
    check.detail.update(base_loss=base_loss, trained_loss=trained_loss)
    check.figure += f"; the export's own loss {base_loss:.4f} -> {trained_loss:.4f} (judge)"
    if not trained_loss < base_loss:
        check.passed = False
        check.figure += ": the exported adapter does not lower it"
        return
    rule = LOGIT_RULES[j.run.layout.dtype]
    if rule.metric != "max":
        check.figure += f"; first loss not compared ({rule.dtype}'s rule bounds the mean logit difference only)"
        return
    tolerance = 2 * rule.tolerance(j.base_logits)
    other_ids, other_labels = fixed_batch(j.run.base, j.run.seed + 1)
    with torch.no_grad():
        other_effect = abs(_loss(j.oracle(other_ids).logits.float(), other_labels) - base_loss)
    observed = abs(check.detail["losses"][0] - base_loss)
    check.detail.update(first_loss_tolerance=tolerance, first_loss_observed=observed, other_batch_effect=other_effect)
    if other_effect <= tolerance:
        check.figure += f"; first loss not compared (another batch moves it {other_effect:.1e} only)"
    elif observed > tolerance:
        check.passed = False
        check.figure += f"; the first loss is not transformers' on the batch: |Δ| {observed:.2e} > {tolerance:.2e}"
    else:
        check.figure += f"; the first is transformers' on the batch (|Δ| {observed:.1e} <= {tolerance:.1e})"


def _export(found: dict[str, Any], j: _Judging) -> Check:
    from dsv4_conformance.judge.artifacts import Expected, judge_adapter_dir

    run = j.run
    expected = Expected(run.lora.targets, run.lora.rank, run.lora.alpha)
    if run.dialect == "transformers":
        problems = judge_adapter_dir(Path(run.adapter_dir), Path(run.base), expected=expected, marker=j.marker)
    else:
        problems = _export_in_dialect(j, expected)
    figure = "a PEFT adapter of the requested targets" if not problems else f"{len(problems)} problem(s): {problems[0]}"
    if run.dialect != "transformers" and not problems:
        figure += f" (dialect {run.dialect}, judged as its transformers reading)"
    return Check("export", not problems, figure, {"problems": [str(p) for p in problems], "dialect": run.dialect})


def _export_in_dialect(j: _Judging, expected: Any) -> list[Any]:
    """An export in another dialect: its files and marker as written, every key in the requested dialect's form, its
    transformers reading held to the same rules as a transformers export, official MTP tensors to the base's."""
    from dsv4_conformance.judge.artifacts import base_weight_shapes, judge_adapter_dir, marker_missing, unreadable
    from dsv4_conformance.judge.dialects import mtp_problems

    adapter, base = Path(j.run.adapter_dir), Path(j.run.base)
    problems = unreadable(adapter) + marker_missing(adapter, j.marker)
    if problems:
        return problems
    reading = j.reading
    problems = reading.problems + judge_adapter_dir(j.adapter, base, expected=expected)
    return problems + mtp_problems(reading.mtp, base_weight_shapes(base), reading.config.get("r"))


def _reload(found: dict[str, Any], j: _Judging) -> Check:
    from dsv4_conformance.judge.oracle import LOGIT_RULES, least_effect, read_adapter

    run, want = j.run, j.trained_logits
    power = least_effect(j.oracle, j.ids, *read_adapter(j.adapter))
    if "float32_logits" in found:  # a run in another dtype, its export imported into a float32 build
        check = _compared("reload", found["float32_logits"], want, LOGIT_RULES["float32"], power)
        check.detail["compared"] = "a float32 build that imported the export"
        return check
    return _compared("reload", found["trained_logits"], want, LOGIT_RULES[run.layout.dtype], power)


#: each check, the rank step whose result it reads, its rule, and whether it needs the oracle (transformers' model)
JUDGED: tuple[tuple[str, str, Callable[[dict[str, Any], _Judging], Check], bool], ...] = (
    ("detect", "detect", _detect, False),
    ("targets", "targets", _targets, False),
    ("load", "base", _load, False),
    ("base_logits", "base", _base_logits, True),
    ("train", "train", _train, False),
    ("export", "export", _export, False),
    ("reload", "reload", _reload, True),
)


def judge_run(
    payloads: Sequence[dict[str, Any]], run: DriverRun, *, marker: str | None, oracle: bool = True
) -> list[Check]:
    """Every check from rank 0's findings; a step that raised on any rank fails its checks, naming rank and error."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dsv4-judge-") as scratch:
        return _judge_steps(payloads, _Judging(run, marker, oracle, Path(scratch)))


def _judge_steps(payloads: Sequence[dict[str, Any]], judging: _Judging) -> list[Check]:
    oracle = judging.with_oracle
    found, seconds = payloads[0]["found"], payloads[0]["seconds"]
    checks = []
    for name, step, rule, needs_oracle in JUDGED:
        raised = [(p["rank"], p["errors"][step]) for p in payloads if step in p["errors"]]
        if raised:
            rank, error = raised[0]
            checks.append(Check(name, False, f"rank {rank}: {error}"[:300], {"errors": dict(raised)}))
        elif step not in seconds:
            checks.append(Check(name, False, "not run: an earlier step failed"))
        elif needs_oracle and not oracle:
            checks.append(Check(name, None, "not compared (--no-oracle)"))
        else:
            t0 = time.perf_counter()
            try:
                check = rule(found, judging)
            except Exception as exc:  # what the driver gave cannot even be judged (PEFT cannot load the export)
                check = Check(name, False, f"cannot be judged: {type(exc).__name__}: {exc}"[:300])
            check.seconds = round(seconds[step] + time.perf_counter() - t0, 3)
            checks.append(check)
    return checks


#: intra-op threads per rank and for the judge unless OMP_NUM_THREADS is set: a tiny model's ops gain nothing from
#: more, and beside other work OpenMP's barriers wait for descheduled threads (docs/performance.md)
RANK_THREADS = 1


def rank_thread_env() -> dict[str, str]:
    """The environment a qualify rank starts with: :data:`RANK_THREADS` threads, unless the user set their own."""
    import os

    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(RANK_THREADS)}


def _judge_threads() -> None:
    """The judge (this process, after the ranks) on :data:`RANK_THREADS` threads, unless the user set their own."""
    import torch

    if rank_thread_env():
        torch.set_num_threads(RANK_THREADS)


#: what the judge imports once the ranks are done (transformers' model, PEFT); the launcher imports them while the
#: ranks work, on a core a one-rank run leaves idle (docs/performance.md, "qualify --driver")
JUDGE_MODULES = ("tiny_models.oracle", "peft")


def _warm_judge() -> threading.Thread:
    """Import :data:`JUDGE_MODULES` in a background thread; one that fails is imported again, and its error judged,
    where the judge needs it."""

    def load() -> None:
        for name in JUDGE_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - the judge's own import reports it
                continue

    thread = threading.Thread(target=load, name="dsv4-judge-warmup", daemon=True)
    thread.start()
    return thread


def find_driver(module: str) -> Driver:
    """The driver ``module`` names, importable from the working directory as under ``python -m`` (a driver is the
    user's file, rarely an installed package; the ranks inherit the path). ValueError saying what to do else."""
    import os
    import sys

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load_driver(module)
    except ModuleNotFoundError as exc:
        where = "run from the directory that holds it, or put that directory on PYTHONPATH"
        raise ValueError(f"--driver {module}: {exc} ({where})") from None
    except TypeError as exc:  # the module has no DRIVER, or not a Driver
        raise ValueError(f"--driver {module}: {exc}") from None


@dataclass(frozen=True)
class WarmDriver:
    """A rank's start-up: the driver's :meth:`~dsv4_conformance.driver.Driver.warm` imports what its build needs, so
    the step times are the steps' own, and an implementation that cannot even import fails the run in one line (the
    launcher names the rank and its error) instead of every step."""

    module: str

    def __call__(self) -> None:
        load_driver(self.module).warm()


def qualify_driver(
    driver: str,
    run: DriverRun,
    *,
    nproc: int,
    timeout_s: float,
    oracle: bool = True,
    preload: Sequence[Callable[[], None]] = (),
    before_go: Callable[[], object] | None = None,
    step: Callable[[str, float], None] | None = None,
) -> list[Check]:
    """Run the driver on ``nproc`` ranks and judge what it did. ``preload``/``before_go``: the launcher's
    (:func:`dsv4_launcher.launch.run_on_ranks`); ``step(what, seconds)``: report the judge's own step."""
    from dsv4_launcher.launch import run_on_ranks

    marker = find_driver(driver).success_marker
    warming = _warm_judge() if oracle else None
    try:
        payloads = run_on_ranks(
            qualify_driver_rank,
            run,
            nproc=nproc,
            timeout_s=timeout_s,
            preload=(WarmDriver(driver), *preload),
            before_go=before_go,
            env=rank_thread_env(),
        )
    finally:
        t0 = time.perf_counter()  # the judge's step counts what is left of its imports
        if warming is not None:  # and no thread is left importing while the interpreter shuts down
            warming.join()
    _judge_threads()
    checks = judge_run(payloads, run, marker=marker, oracle=oracle)
    if step is not None:
        step("judge: transformers + PEFT, the conformance rules", time.perf_counter() - t0)
    return checks


def run_options() -> dict[str, Any]:
    """What every driver run takes as fixed, for the report's options: plain SGD's step, the fixed batch's size."""
    from dsv4_conformance.judge.oracle import BATCH
    from dsv4_lora.qualify_driver_rank import LR

    return {"lr": LR, "batch": BATCH, "seq_len": None}


def driver_run(
    driver: str,
    base: str,
    out: str,
    *,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    steps: int = 3,
    seed: int = 0,
    dialect: str = "transformers",
) -> DriverRun:
    """The run ``qualify --driver`` makes from its options: the export goes to ``OUT/adapter``."""
    lora = LoraSpec(tuple(targets), rank, alpha)
    layout = Layout(tp, ep, pp, dtype)
    return DriverRun(driver, base, str(Path(out) / "adapter"), layout, lora, steps, seed, dialect=dialect)


@dataclass(frozen=True)
class DefaultBase:
    """The embedded default base, a deterministic tiny V4 checkpoint: rank 0 writes it while the ranks start up
    (they import transformers anyway; the launcher then never does)."""

    preset: str
    seed: int
    path: str

    def __call__(self) -> None:
        from dsv4_launcher.launch import launched_world

        world = launched_world()
        if world is None or world.rank == 0:
            from tiny_models.oracle import write_checkpoint

            write_checkpoint(self.preset, self.path, seed=self.seed)


#: the distributions a report names the versions of
REPORTED_VERSIONS = ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors", "dsv4-lora")


def versions() -> dict[str, str]:
    """The installed version of each of :data:`REPORTED_VERSIONS` ("absent" when not installed)."""
    import importlib.metadata as md

    out = {}
    for dist in REPORTED_VERSIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out
