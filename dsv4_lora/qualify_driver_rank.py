"""The ranks' side of ``dsv4-lora qualify --driver``: every step calls the driver alone and returns plain data.

Nothing here judges; :mod:`dsv4_lora.qualify_driver` does, in the launcher, with the conformance judge. A step that
raises is recorded as ``"ExcType: message"``; the steps after it that need its result are not run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import DriverMissing, Layout, LoraSpec, load_driver
from dsv4_conformance.judge.oracle import fixed_batch

#: plain SGD's step size on the one fixed batch (the contract's ``train_step`` is plain SGD)
LR = 0.5
#: the architecture a look-alike config names: the same config must not be recognised under it
LOOKALIKE = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class DriverRun:
    """What every rank runs: the driver module, the base, the layout and adapter, where the export goes."""

    driver: str
    base: str
    adapter_dir: str
    layout: Layout
    lora: LoraSpec
    steps: int = 3
    seed: int = 0
    timeout_s: float = 60.0  # the export's, on every rank
    dialect: str = "transformers"  # the export's naming dialect (one the driver declares)


@dataclass
class _State:
    rank: int
    run: DriverRun
    driver: Any
    config: dict[str, Any]
    found: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    ids: Any = None
    labels: Any = None


def _plain(tensor: Any) -> Any:
    """A tensor as numpy: a rank that has exited cannot hand over a tensor's shared memory."""
    return None if tensor is None else tensor.detach().cpu().float().numpy()


def _detect(s: _State) -> None:
    lookalike = {**s.config, "architectures": [LOOKALIKE]}
    s.found["recognised"] = bool(s.driver.recognises(s.config))
    s.found["recognised_lookalike"] = bool(s.driver.recognises(lookalike))


def _targets(s: _State) -> None:
    s.found["modules"] = sorted(s.driver.qualify(s.run.lora.targets, s.config))


def _base(s: _State) -> None:
    """Built without an adapter: the base alone, its load report and its logits."""
    model = s.driver.build(Path(s.run.base), s.run.layout, None)
    report = s.driver.load_report(model)
    s.found["load"] = {"loaded": report.loaded, "missing": list(report.missing), "unexpected": list(report.unexpected)}
    s.found["base_logits"] = _plain(s.driver.logits(model, s.ids))


def _train(s: _State) -> None:
    """Built again with the adapter; ``steps`` SGD steps on the one batch, each step's loss before it."""
    s.model = s.driver.build(Path(s.run.base), s.run.layout, s.run.lora)
    s.found["losses"] = [float(s.driver.train_step(s.model, s.ids, s.labels, LR)) for _ in range(s.run.steps)]
    s.found["trained_logits"] = _plain(s.driver.logits(s.model, s.ids))


def _export(s: _State) -> None:
    dialect = {} if s.run.dialect == "transformers" else {"dialect": s.run.dialect}  # the contract's optional keyword
    s.driver.export(s.model, Path(s.run.adapter_dir), s.run.timeout_s, **dialect)
    s.found["exported"] = True


def _reload(s: _State) -> None:
    """A run in another dtype: its export imported (the contract's optional ``import_adapter``) into a float32 build
    of the same base, whose logits the reload is compared with in float32, where one module's delta is above the
    rule (bf16 rounding of a whole forward is not)."""
    if s.run.layout.dtype == "float32" or not type(s.driver).implements("import_adapter"):
        return
    model = s.driver.build(Path(s.run.base), replace(s.run.layout, dtype="float32"), s.run.lora)
    s.driver.import_adapter(model, Path(s.run.adapter_dir))
    s.found["float32_logits"] = _plain(s.driver.logits(model, s.ids))


#: (step, what its progress line says, whether the steps after it need it)
STEPS: tuple[tuple[str, str, Callable[[_State], None], bool], ...] = (
    ("detect", "detect: the base and a V3 look-alike of it", _detect, False),
    ("targets", "targets: the modules LoRA would wrap", _targets, False),
    ("base", "build the base alone: load report and logits", _base, True),
    ("train", "build with LoRA and train on one batch", _train, True),
    ("export", "export the adapter (collective)", _export, True),
    ("reload", "import the export into a float32 build (a run in another dtype)", _reload, True),
)


def _say_step(rank: int, what: str, seconds: float) -> None:
    from dsv4_launcher.progress import forwarding

    send = forwarding()
    if rank == 0 and send is not None:
        send(("step", (what, seconds)))


def qualify_driver_rank(rank: int, world_size: int, run: DriverRun) -> dict[str, Any]:
    """Every step on this rank; what each found, the error each raised, and each one's seconds."""
    state = _State(rank, run, load_driver(run.driver), json.loads((Path(run.base) / "config.json").read_text()))
    state.ids, state.labels = fixed_batch(run.base, run.seed)
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, what, step, needed in STEPS:
        t0 = time.perf_counter()
        try:
            step(state)
        except (Exception, DriverMissing) as exc:  # the judge names it: a method missing fails its check, here only
            errors[name] = f"{type(exc).__name__}: {exc}"
        seconds[name] = round(time.perf_counter() - t0, 3)
        _say_step(rank, what, seconds[name])
        if name in errors and needed:
            break
    return {"rank": rank, "found": state.found, "errors": errors, "seconds": seconds}
