"""The numerical oracle and its tolerance rules, one home for the suites and the command line alike.

The oracle is transformers' ``DeepseekV4ForCausalLM`` of the base with an adapter applied by PEFT itself
(:func:`peft_logits`) or as ``W + s·B@A`` written out here (:func:`delta_logits`, so one module's delta can be left
out and the loss differentiated). A comparison is held to a :class:`Rule` and counts only with its power measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv4_conformance.judge.artifacts import ADAPTER_FILE, CONFIG_FILE, PEFT_PREFIX

#: module -> (A, B) as stored, with the adapter's scale
Adapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Rule:
    """A tolerance in units of ``eps(dtype) × max|reference|``, never an absolute figure.

    Two correct computations of the same logits differ by rounding only, and rounding is relative to the values
    rounded: each side sums in its own order through every layer, and a merge rounds ``W + s·B@A`` once per weight.
    ``metric`` is the statistic of ``|got - want|`` held to it: the largest, or the mean where single values are
    not stable (bf16 routing)."""

    units: float
    dtype: str = "float32"  # a torch dtype name
    metric: str = "max"  # "max" or "mean" absolute difference

    def at_scale(self, scale: float) -> float:
        return self.units * torch.finfo(getattr(torch, self.dtype)).eps * scale

    def tolerance(self, reference: torch.Tensor) -> float:
        return self.at_scale(float(reference.detach().abs().max()))

    def difference(self, got: torch.Tensor, want: torch.Tensor) -> float:
        diff = (got.detach().cpu().float() - want.detach().cpu().float()).abs()
        return float(diff.max() if self.metric == "max" else diff.mean())

    def compare(self, got: torch.Tensor, want: torch.Tensor) -> Comparison:
        """``got`` against the reference ``want``, the tolerance scaled by ``max|want|``."""
        scale = float(want.detach().cpu().float().abs().max())
        return Comparison(self.difference(got, want), self.at_scale(scale), scale)


@dataclass(frozen=True)
class Comparison:
    """One :class:`Rule` applied: the observed difference, the tolerance it was held to and the margin."""

    observed: float
    tolerance: float
    scale: float  # max|reference|

    @property
    def passed(self) -> bool:
        return self.observed <= self.tolerance

    @property
    def margin(self) -> float:
        """tolerance / observed (inf when the two are identical)."""
        return self.tolerance / self.observed if self.observed > 0 else float("inf")

    def detail(self) -> dict[str, float | None]:
        """For a JSON report: ``margin`` is null when the two are identical (JSON has no infinity)."""
        margin = self.margin if self.observed > 0 else None
        return {"observed": self.observed, "tolerance": self.tolerance, "logit_scale": self.scale, "margin": margin}


#: 256 units: a few per layer's summation order over the tiny models' handful of layers, with room for the merge
LOGIT_RULE = Rule(256)
#: bf16 logits: 4 units of the mean: routing and indexer top-k flip under bf16 rounding and move single tokens far,
#: so only a mean is stable there (a reload of a bf16-trained adapter is compared in float32, under LOGIT_RULE)
BF16_LOGIT_RULE = Rule(4, "bfloat16", "mean")
#: the logit rule for a parameter dtype
LOGIT_RULES = {rule.dtype: rule for rule in (LOGIT_RULE, BF16_LOGIT_RULE)}
#: gradients: the same rule, per tensor, over max|gradient| + max|parameter| / lr (the step's own rounding)
GRADIENT_RULE = Rule(256)


def read_adapter(adapter_dir: Path) -> tuple[Adapter, float]:
    """The adapter's (A, B) per transformers module, and its scale (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    import json

    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / CONFIG_FILE).read_text())
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_FILE))
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, half = key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)
        found.setdefault(module, {})[half.removesuffix(".weight")] = value.float()
    r = config["r"]
    scale = config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)
    return {m: (h["A"], h["B"]) for m, h in found.items()}, scale


#: sequences in the fixed batch every program and qualify draws
BATCH = 2


def fixed_batch(base: str | Path, seed: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, next-token labels), the same on every rank and in the judge: ``batch`` sequences drawn from
    ``seed``, long enough for every attention of the base (``tiny_models.presets.min_seq_len``)."""
    import json

    from transformers import DeepseekV4Config

    from tiny_models.presets import min_seq_len

    config = DeepseekV4Config.from_dict(json.loads((Path(base) / "config.json").read_text()))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, min_seq_len(config)), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def base_model(base: Path) -> Any:
    """transformers' model of ``base`` in float32, evaluation mode (the oracle's own loader, strict)."""
    from tiny_models.oracle import load_oracle

    return load_oracle(base)


def _weights(model: Any, adapter: Adapter, scale: float, leave_out: str | None = None) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {f"{m}.weight": params[f"{m}.weight"] + scale * (b @ a) for m, (a, b) in adapter.items() if m != leave_out}


def delta_logits(model: Any, ids: torch.Tensor, adapter: Adapter, scale: float, leave_out: str | None = None) -> Any:
    """Logits of ``model`` with every module's weight ``W + scale·B@A`` (``leave_out``'s delta left out)."""
    with torch.no_grad():
        return torch.func.functional_call(model, _weights(model, adapter, scale, leave_out), (ids,)).logits.float()


def peft_logits(base: Path, adapter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """PEFT's own reload of ``adapter_dir`` onto the base, merged; raises if PEFT left any tensor of the file out."""
    from peft import PeftModel

    adapter, _ = read_adapter(adapter_dir)
    model = PeftModel.from_pretrained(base_model(base), str(adapter_dir))
    params = dict(model.named_parameters())
    dropped = [
        f"{m}.lora_{h}"
        for m, (a, b) in adapter.items()
        for h, t in (("A", a), ("B", b))
        if not torch.equal(params.get(f"{PEFT_PREFIX}{m}.lora_{h}.default.weight", torch.empty(0)).float(), t)
    ]
    if dropped:
        raise AssertionError(f"PEFT did not load {len(dropped)} tensors of {adapter_dir}, e.g. {dropped[0]}")
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        return merged(ids).logits.float()


@dataclass(frozen=True)
class Power:
    """The smallest defect a comparison claims to see, measured: the module whose delta moves the logits least."""

    module: str
    effect: float  # max |Δ logits| when that module's delta is left out

    def exceeds(self, tolerance: float) -> bool:
        return self.effect > tolerance


def least_effect(model: Any, ids: torch.Tensor, adapter: Adapter, scale: float) -> Power:
    """Leave each module's delta out in turn (one target in one layer) and find the one that moves the logits least."""
    full = delta_logits(model, ids, adapter, scale)
    effects = {
        m: float((delta_logits(model, ids, adapter, scale, leave_out=m) - full).abs().max()) for m in sorted(adapter)
    }
    module = min(effects, key=effects.__getitem__)
    return Power(module, effects[module])


def oracle_gradients(
    model: Any, ids: torch.Tensor, labels: torch.Tensor, adapter: Adapter, scale: float
) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The loss (mean cross entropy over every position) and its gradient with respect to each module's A and B."""
    leaves = {m: (a.clone().requires_grad_(True), b.clone().requires_grad_(True)) for m, (a, b) in adapter.items()}
    params = dict(model.named_parameters())
    weights = {f"{m}.weight": params[f"{m}.weight"].detach() + scale * (b @ a) for m, (a, b) in leaves.items()}
    logits = torch.func.functional_call(model, weights, (ids,)).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return float(loss), {m: (a.grad, b.grad) for m, (a, b) in leaves.items()}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().float() - b.detach().cpu().float()).abs().max())


__all__ = [
    "BF16_LOGIT_RULE",
    "GRADIENT_RULE",
    "LOGIT_RULE",
    "LOGIT_RULES",
    "Comparison",
    "Power",
    "Rule",
    "base_model",
    "delta_logits",
    "least_effect",
    "least_layer_effect",
    "max_abs",
    "oracle_gradients",
    "peft_logits",
    "read_adapter",
]


def least_layer_effect(model: Any, ids: torch.Tensor, rule: Rule | None = None) -> Power:
    """The base's smallest defect a logit comparison claims to see: one layer's attention output projection
    (``o_b_proj``) gone, least over the layers, by ``rule``'s statistic (default: the largest difference). The
    weights are restored exactly after each."""
    with torch.no_grad():
        full = model(ids).logits.float()
        effects = {}
        for i, layer in enumerate(model.model.layers):
            weight = layer.self_attn.o_b_proj.weight
            saved = weight.clone()
            weight.zero_()
            changed = model(ids).logits.float()
            effects[f"model.layers.{i}.self_attn.o_b_proj"] = (
                rule.difference(changed, full) if rule else max_abs(changed, full)
            )
            weight.copy_(saved)
    module = min(effects, key=effects.__getitem__)
    return Power(module, effects[module])
