"""How qualify compares logits, and how it proves each comparison could have failed.

A comparison holds native logits against a reference within a tolerance from the dtype's rounding (:class:`LogitCheck`).
A tolerance only means something below the smallest defect the comparison claims to catch, so :func:`adapter_effects`
measures how far each target's and layer's delta moves the reloaded logits, and :class:`Power` judges: a comparison
whose tolerance is not below every effect is inconclusive."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dsv4_conformance.judge.oracle import LOGIT_RULE

__all__ = [
    "LOGIT_CHECKS",
    "LogitCheck",
    "LogitComparison",
    "Power",
    "adapter_effects",
    "compare_logits",
]


@dataclass(frozen=True)
class LogitCheck:
    """How native logits are compared with transformers' logits in one parameter dtype.

    The tolerance scales with the logits: ``ulps * eps(dtype) * max|reference logits|``. Two correct forwards
    differ by rounding only, and rounding errors are relative to the values rounded: each side sums in its own
    order through every layer, and a merged reload also rounds ``W + (alpha/r) B@A`` once per target weight, so
    the difference is a number of units of ``eps * scale``, not a fixed absolute figure. ``ulps`` is that number
    with room to spare; every comparison reports its ``margin`` = tolerance / observed difference.
    """

    dtype: str  # a torch dtype name
    metric: str  # "max" or "mean" absolute difference
    ulps: float  # the tolerance in units of eps(dtype) * max|reference logits|

    def tolerance(self, scale: float) -> float:
        import torch

        return self.ulps * torch.finfo(getattr(torch, self.dtype)).eps * scale


#: float32: the conformance judge's rule, in units of the max |Δ| (one home for it: dsv4_conformance.judge.oracle).
#: bfloat16: 4 units of the mean |Δ|: routing and indexer top-k flip under bf16 rounding and move single tokens far,
#: so only a mean is stable there. The reload of a bf16-trained adapter is compared in float32 (see
#: impl.cli.qualify), where the float32 rule has the power the bf16 one lacks.
LOGIT_CHECKS = {c.dtype: c for c in (LogitCheck("float32", "max", LOGIT_RULE.units), LogitCheck("bfloat16", "mean", 4))}


@dataclass(frozen=True)
class LogitComparison:
    """One :class:`LogitCheck` applied: the observed difference, the tolerance it was held to and the margin."""

    observed: float
    tolerance: float
    scale: float  # max|reference logits|

    @property
    def passed(self) -> bool:
        return self.observed <= self.tolerance

    @property
    def margin(self) -> float:
        """tolerance / observed (inf when the two are identical)."""
        return self.tolerance / self.observed if self.observed > 0 else float("inf")

    def detail(self) -> dict[str, float | None]:
        """For the JSON report: ``margin`` is null when the logits are identical (JSON has no infinity)."""
        margin = self.margin if self.observed > 0 else None
        return {"observed": self.observed, "tolerance": self.tolerance, "logit_scale": self.scale, "margin": margin}


def difference(got: Any, want: Any, metric: str) -> float:
    diff = (got.cpu().float() - want.cpu().float()).abs()
    return float(diff.max() if metric == "max" else diff.mean())


def compare_logits(got: Any, want: Any, check: LogitCheck) -> LogitComparison:
    scale = float(want.cpu().float().abs().max())
    return LogitComparison(difference(got, want, check.metric), check.tolerance(scale), scale)


@dataclass(frozen=True)
class Power:
    """The smallest defects a reload comparison claims to catch, measured: per target and per layer, how far the
    logits move when that part of the adapter is removed, against the tolerance the comparison uses.

    For the reload the defects are an exported adapter that lost one target, or one layer, or scaled one target's
    delta; they move the reloaded logits by the *effect* of that target or layer, measured on the reloaded PEFT
    model itself (:func:`adapter_effects`: that part's LoRA scaling set to zero, the logits recomputed). A
    comparison whose tolerance is not below every effect is inconclusive."""

    tolerance: float
    by_target: dict[str, float]
    by_layer: dict[int, float]

    @property
    def smallest(self) -> tuple[str, float]:
        """The weakest part (``"target wo_a"`` / ``"layer 2"``) and its effect."""
        parts = [(f"target {t}", e) for t, e in self.by_target.items()]
        parts += [(f"layer {n}", e) for n, e in self.by_layer.items()]
        return min(parts, key=lambda p: p[1]) if parts else ("no adapter", 0.0)

    @property
    def conclusive(self) -> bool:
        """Every single target and layer moves the logits by more than the tolerance."""
        return self.smallest[1] > self.tolerance

    def detail(self) -> dict[str, Any]:
        part, effect = self.smallest
        return {
            "effect_by_target": self.by_target,
            "effect_by_layer": {str(n): e for n, e in self.by_layer.items()},
            "smallest_effect": effect,
            "smallest_effect_of": part,
            "power": effect / self.tolerance if self.tolerance > 0 else None,
            "conclusive": self.conclusive,
        }


def adapter_effects(
    peft_model: Any,
    logits: Callable[[], Any],
    parse: Callable[[str], tuple[int | None, str] | None],
    metric: str,
    tolerance: float,
) -> Power:
    """Per target and per layer, ``metric`` of (logits with the whole adapter - logits without that part).

    ``peft_model`` is an unmerged PEFT model; ``logits()`` runs it on the evaluation batch; ``parse(module name)``
    names the (layer, target) a LoRA module adapts, or None. A part is removed by setting its modules' LoRA
    scaling to zero, the switch PEFT's own forward (and the grouped layer's) multiplies the delta by."""
    modules: list[tuple[int | None, str, Any]] = []
    for name, module in peft_model.named_modules():
        hit = parse(name) if isinstance(getattr(module, "scaling", None), dict) else None
        if hit is not None:
            modules.append((*hit, module))
    full = logits()

    def without(parts: Iterable[Any]) -> float:
        saved = [(m, dict(m.scaling)) for m in parts]
        try:
            for m, _ in saved:
                m.scaling.update(dict.fromkeys(m.scaling, 0.0))
            return difference(logits(), full, metric)
        finally:
            for m, scaling in saved:
                m.scaling.update(scaling)

    targets = dict.fromkeys(t for _, t, _ in modules)
    layers = sorted({n for n, _, _ in modules if n is not None})
    return Power(
        tolerance,
        {t: without(m for _, tt, m in modules if tt == t) for t in targets},
        {n: without(m for nn, _, m in modules if nn == n) for n in layers},
    )
