"""An adapter written in another naming dialect, read as transformers' dialect, so that one set of rules (and PEFT's
reload on transformers) judges every export.

Each dialect names a main-attention module its own way; the consumers' loaders read these names
(``dsv4_conformance/judge/consumers.py``):

| dialect | target ``t`` of layer ``N`` | read by |
|---|---|---|
| ``transformers`` | ``model.layers.N.self_attn.<transformers leaf of t>`` | PEFT on transformers |
| ``official`` | ``layers.N.attn.t``; the MTP block's ``mtp.N.attn.t`` | vLLM |
| ``sglang`` | ``model.layers.N.self_attn.t`` | SGLang |

Nothing here imports an implementation. An export asked for one dialect that wrote another fails: every key must be
of the requested dialect's form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import MAIN_ATTENTION
from dsv4_conformance.judge.artifacts import ADAPTER_FILE, CONFIG_FILE, PEFT_PREFIX, TRANSFORMERS_LEAF, Problem

_TARGET = "|".join(MAIN_ATTENTION)
#: a main-attention module in each dialect other than transformers': (layer, target)
_MODULE = {
    "official": re.compile(rf"^layers\.(?P<layer>\d+)\.attn\.(?P<target>{_TARGET})$"),
    "sglang": re.compile(rf"^model\.layers\.(?P<layer>\d+)\.self_attn\.(?P<target>{_TARGET})$"),
}
#: the MTP block's main attention, which only the official dialect names (transformers has no MTP layer)
_MTP = re.compile(rf"^mtp\.(?P<layer>\d+)\.attn\.(?P<target>{_TARGET})$")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<half>lora_[AB]\.weight)$")


@dataclass
class Reading:
    """An adapter in ``dialect`` read as transformers': the renamed tensors and config, the official MTP tensors
    (judged against the base by their own names), and what could not be read."""

    dialect: str
    tensors: dict[str, Any] = field(default_factory=dict)
    mtp: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def _renamed(key: str, dialect: str) -> tuple[str | None, str | None, bool]:
    """(transformers' module for ``key``, its target, whether it is an official MTP key); None, None: not of the
    dialect's form."""
    m = _KEY.match(key)
    if m is None:
        return None, None, False
    hit = _MODULE[dialect].match(m["module"])
    if hit is not None:
        return f"model.layers.{hit['layer']}.self_attn.{TRANSFORMERS_LEAF[hit['target']]}", hit["target"], False
    return None, None, dialect == "official" and _MTP.match(m["module"]) is not None


def read_as_transformers(tensors: Mapping[str, Any], config: Mapping[str, Any], dialect: str) -> Reading:
    """``tensors`` and ``config`` (an adapter's) in ``dialect``, renamed to transformers' dialect.

    ``target_modules`` is the consumer's to read in its own tree (``judge/consumers.py`` holds each engine's
    reading): here a list must name the leaf of every adapted module, and the reading's is exactly the adapted
    modules, so that PEFT's reload on transformers reaches those and nothing else."""
    reading = Reading(dialect, config=dict(config))
    foreign, modules, leaves = [], set(), set()
    for key, value in tensors.items():
        module, target, mtp = _renamed(key, dialect)
        if mtp:
            reading.mtp[key] = value
        elif module is None:
            foreign.append(key)
        else:
            reading.tensors[f"{PEFT_PREFIX}{module}.{_KEY.match(key)['half']}"] = value
            modules.add(module)
            leaves.add(target)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        what = f"{len(foreign)} keys not of dialect {dialect}'s main-attention form, e.g. {foreign[0]}{more}"
        reading.problems.append(Problem("names", ADAPTER_FILE, what))
    targets = config.get("target_modules")
    if isinstance(targets, str):
        why = f"target_modules {targets!r} is a regex over dialect {dialect}'s module tree: it cannot be judged"
        reading.problems.append(Problem("targets", CONFIG_FILE, why))
    elif isinstance(targets, list) and not leaves <= set(targets):
        why = f"target_modules {targets} leaves out {sorted(leaves - set(targets))}, which the adapter holds"
        reading.problems.append(Problem("targets", CONFIG_FILE, why))
    if targets is not None:
        reading.config["target_modules"] = sorted(modules)
    return reading


def mtp_problems(mtp: Mapping[str, Any], base_shapes: Mapping[str, tuple[int, ...]], r: Any) -> list[Problem]:
    """The official MTP tensors, which transformers' reading cannot hold: each the shape the base's weight of the
    same name needs (lora_A ``(r, in)``, lora_B ``(out, r)``), and finite."""
    import torch

    problems = []
    for key, tensor in sorted(mtp.items()):
        module, half = _KEY.match(key).group("module", "half")
        weight = base_shapes.get(f"{module}.weight")
        want = None if weight is None else ((r, weight[1]) if half.startswith("lora_A") else (weight[0], r))
        if tuple(tensor.shape) != want:
            what = f"{tuple(tensor.shape)}, the base's {module}.weight {weight} needs {want}"
            problems.append(Problem("shapes", key, what))
        if not (tensor.is_floating_point() and bool(torch.isfinite(tensor).all())):
            problems.append(Problem("finite", key, "not finite (or not floating point)"))
    return problems


def write_as_transformers(adapter: Path, dialect: str, out: Path) -> Reading:
    """The adapter in ``adapter`` (dialect ``dialect``) written to ``out`` in transformers' dialect; the reading says
    what could not be read. The marker and other files stay behind: the original is judged for them."""
    from safetensors.torch import load_file, save_file

    reading = read_as_transformers(
        load_file(str(adapter / ADAPTER_FILE)), json.loads((adapter / CONFIG_FILE).read_text()), dialect
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file(reading.tensors, str(out / ADAPTER_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(reading.config, indent=2))
    return reading


__all__ = ["Reading", "mtp_problems", "read_as_transformers", "write_as_transformers"]
