"""An exported adapter directory judged from its files alone, against the base it was trained on.

Nothing here imports an implementation: the expected names come from transformers' own ``DeepseekV4ForCausalLM``
(built on the meta device from the base's config), the expected shapes from the base's safetensors headers, the
target matching from PEFT's own ``check_target_module_exists``. Each problem is one line per cause, naming the file,
tensor or target, with a count and an example when a cause has many instances.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: the files PEFT reads, and the pickled formats an adapter must not use
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PICKLED = ("adapter_model.bin", "*.pt", "*.pth", "*.pkl", "*.pickle")
#: PEFT's prefix of every saved key (``PeftModel.save_pretrained``)
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
#: transformers' leaf of each main-attention target, under ``model.layers.N.self_attn``
TRANSFORMERS_LEAF = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
#: the nested modules that share a main target's leaf name: a target must never reach them
NESTED = (".compressor.", ".indexer.")


@dataclass(frozen=True)
class Problem:
    check: str  # files, format, config, names, targets, shapes, scale, finite, marker
    where: str  # the file, tensor or target
    what: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.where}: {self.what}"


@dataclass(frozen=True)
class Expected:
    """What the adapter should hold: these targets in every layer, at this rank and scale (alpha / rank)."""

    targets: tuple[str, ...]
    rank: int
    alpha: float


def _grouped(check: str, where: str, what: str, items: list[str]) -> list[Problem]:
    if not items:
        return []
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return [Problem(check, where, f"{len(items)} {what}, e.g. {items[0]}{more}")]


@cache
def transformers_modules(config_json: str) -> tuple[tuple[str, str, tuple[int, ...] | None], ...]:
    """(name, class name, weight shape) of every module of transformers' model for a base's config.json text."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    out = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        out.append((name, type(module).__name__, tuple(weight.shape) if isinstance(weight, torch.Tensor) else None))
    return tuple(out)


def main_target_module(layer: int, target: str) -> str:
    return f"model.layers.{layer}.self_attn.{TRANSFORMERS_LEAF[target]}"


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (the JSON before the data), without reading the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100 * 2**20:
            raise ValueError(f"header length {size} is not that of a safetensors file")
        return json.loads(f.read(size))


def base_weight_shapes(base: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the base by its name in the base's layout (official, or transformers'), with its shape, from
    the safetensors headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(base.glob("*.safetensors")):
        shapes.update({k: tuple(v["shape"]) for k, v in read_header(f).items() if k != "__metadata__"})
    return shapes


def _files(adapter: Path) -> list[Problem]:
    problems = []
    if not adapter.is_dir():
        return [Problem("files", str(adapter), "no such directory")]
    for name in (ADAPTER_FILE, CONFIG_FILE):
        if not (adapter / name).is_file():
            problems.append(Problem("files", name, "missing: PEFT needs it"))
    pickled = sorted({p.name for pattern in PICKLED for p in adapter.glob(pattern)})
    if pickled:
        problems.append(Problem("files", ", ".join(pickled), "pickled weights (code runs on load); use safetensors"))
    return problems


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _config(adapter: Path, expected: Expected | None) -> tuple[dict[str, Any] | None, list[Problem]]:
    try:
        config = json.loads((adapter / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        return None, [Problem("format", CONFIG_FILE, f"not JSON: {exc}")]
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(Problem("config", CONFIG_FILE, f"peft_type is {config.get('peft_type')!r}, not 'LORA'"))
    r, alpha = config.get("r"), config.get("lora_alpha")
    # JSON's true reads as 1 in Python (bool is an int), but it is no number: an engine may read it otherwise
    if not (_number(r) and isinstance(r, int) and r > 0):
        problems.append(Problem("config", CONFIG_FILE, f"r is {r!r}, not a positive integer"))
    if not (_number(alpha) and alpha > 0 and math.isfinite(alpha)):
        problems.append(Problem("config", CONFIG_FILE, f"lora_alpha is {alpha!r}, not a positive number"))
    if not isinstance(config.get("target_modules"), list | str):
        problems.append(Problem("config", CONFIG_FILE, "target_modules is missing: PEFT would wrap nothing"))
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            problems.append(Problem("scale", CONFIG_FILE, f"{key} {config[key]} gives modules another scale"))
    if expected is not None and not problems:
        scale = alpha / (r**0.5 if config.get("use_rslora") else r)
        want = expected.alpha / expected.rank
        if abs(scale - want) > 1e-6 * want:
            problems.append(
                Problem("scale", CONFIG_FILE, f"scale {scale:g} (r={r}, lora_alpha={alpha}) but {want:g} was trained")
            )
    return config, problems


def _tensors(adapter: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    try:
        from safetensors.torch import load_file

        return load_file(str(adapter / ADAPTER_FILE)), []
    except Exception as exc:  # any failure to parse is the finding
        return None, [Problem("format", ADAPTER_FILE, f"not a readable safetensors file: {exc}")]


def _names(tensors: Mapping[str, Any], modules: set[str]) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
    """The adapted modules (module -> {"A": tensor, "B": tensor}) and what is wrong with the keys."""
    found: dict[str, dict[str, Any]] = {}
    unparsed, unknown = [], []
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            unparsed.append(key)
        elif m["module"] not in modules:
            unknown.append(key)
        else:
            found.setdefault(m["module"], {})[m["half"]] = value
    halves = [f"{mod} has only lora_{next(iter(h))}" for mod, h in found.items() if len(h) != 2]
    problems = _grouped(
        "names", ADAPTER_FILE, f"keys not of PEFT's form {PEFT_PREFIX}<module>.lora_A|B.weight", unparsed
    )
    problems += _grouped(
        "names",
        ADAPTER_FILE,
        "keys naming no module of transformers' DeepseekV4ForCausalLM (PEFT loads nothing there)",
        unknown,
    )
    problems += _grouped("names", ADAPTER_FILE, "modules missing a LoRA half", halves)
    return {m: h for m, h in found.items() if len(h) == 2}, problems


def _coverage(found: Iterable[str], expected: Expected, layers: int) -> list[Problem]:
    want = {main_target_module(i, t) for i in range(layers) for t in expected.targets}
    have = set(found)
    return _grouped("targets", ADAPTER_FILE, "requested modules missing", sorted(want - have)) + _grouped(
        "targets", ADAPTER_FILE, "modules adapted that were not requested", sorted(have - want)
    )


def _lora_wraps(class_name: str) -> bool:
    """Whether PEFT's LoRA can wrap a module of transformers' V4 tree of this class: the layer types its error names
    (``Target module ... is not supported``), subclasses included (the grouped ``o_a_proj`` is a ``Linear``)."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4
    from transformers.pytorch_utils import Conv1D

    cls = getattr(torch.nn, class_name, None) or getattr(modeling_deepseek_v4, class_name, None)
    nn = torch.nn
    wrapped = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    return isinstance(cls, type) and issubclass(cls, wrapped)


def _target_modules(
    config: Mapping[str, Any], found: Iterable[str], modules: Iterable[tuple[str, str, Any]]
) -> list[Problem]:
    """PEFT's own matching of ``target_modules`` over transformers' modules: nothing nested reached, nothing
    reached that LoRA cannot wrap (a norm, a router: PEFT refuses to load), every adapted module reached (an
    unreached one is loaded nowhere: the adapter silently loses it)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    cfg = LoraConfig(target_modules=config["target_modules"], r=1)
    matched = {name: cls for name, cls, _ in modules if check_target_module_exists(cfg, name)}
    nested = sorted(m for m in matched if any(n in m for n in NESTED))
    unwrappable = sorted(f"{m} ({cls})" for m, cls in matched.items() if not _lora_wraps(cls))
    unreached = sorted(set(found) - set(matched))
    where = f"{CONFIG_FILE} target_modules {config['target_modules']!r}"
    return (
        _grouped("targets", where, "indexer or compressor modules matched by PEFT", nested)
        + _grouped("targets", where, "modules matched that LoRA cannot wrap (PEFT refuses to load)", unwrappable)
        + _grouped("targets", where, "adapted modules not matched (PEFT would drop their weights)", unreached)
    )


def _shapes(
    found: Mapping[str, Mapping[str, Any]], base_shapes: Mapping[str, tuple[int, ...]], r: Any
) -> list[Problem]:
    from tiny_models.oracle import transformers_to_official_name

    wrong = []
    for module, halves in sorted(found.items()):
        # a base in the official layout, or in either that transformers' save_pretrained writes
        official = transformers_to_official_name(f"{module}.weight")
        names = (official, f"model.{official}", f"{module}.weight")
        weight = next((base_shapes[n] for n in names if n in base_shapes), None)
        if weight is None or len(weight) != 2:
            wrong.append(f"{module}: the base has no 2-D weight for it")
            continue
        out, inp = weight
        a, b = tuple(halves["A"].shape), tuple(halves["B"].shape)
        if a != (r, inp) or b != (out, r):
            wrong.append(
                f"{module}: lora_A {a}, lora_B {b}; the base weight {weight} with r={r} needs {(r, inp)}, {(out, r)}"
            )
    return _grouped("shapes", ADAPTER_FILE, "modules with shapes that do not fit the base", wrong)


def _finite(found: Mapping[str, Mapping[str, Any]]) -> list[Problem]:
    import torch

    bad = [
        f"{m}.lora_{h}"
        for m, halves in sorted(found.items())
        for h, t in sorted(halves.items())
        if not (t.is_floating_point() and bool(torch.isfinite(t).all()))
    ]
    return _grouped("finite", ADAPTER_FILE, "tensors not finite (or not floating point)", bad)


def judge_adapter_dir(
    adapter: Path, base: Path, *, expected: Expected | None = None, marker: str | None = None
) -> list[Problem]:
    """Every problem of the adapter in ``adapter`` for the base directory ``base``; ``[]`` means valid.

    ``expected``: the targets, rank and alpha it was trained with (then every layer's requested modules must be
    there, and nothing else). ``marker``: the success marker the implementation declares; it must be there."""
    adapter, base = Path(adapter), Path(base)
    problems = _files(adapter)
    if problems:
        return problems
    config, problems = _config(adapter, expected)
    tensors, more = _tensors(adapter)
    problems += more
    if config is None or tensors is None:
        return problems
    config_text = (base / "config.json").read_text()
    modules = transformers_modules(config_text)
    names = {name for name, _, _ in modules}
    found, more = _names(tensors, names)
    problems += more
    if expected is not None:
        layers = json.loads(config_text)["num_hidden_layers"]
        problems += _coverage(found, expected, layers)
    if "target_modules" in config:
        problems += _target_modules(config, found, modules)
    problems += _shapes(found, base_weight_shapes(base), config.get("r"))
    problems += _finite(found)
    return problems + marker_missing(adapter, marker)


def marker_missing(adapter: Path, marker: str | None) -> list[Problem]:
    """The declared success marker, not there."""
    if marker is None or (Path(adapter) / marker).is_file():
        return []
    return [Problem("marker", marker, "the declared success marker is not there")]


def unreadable(adapter: Path) -> list[Problem]:
    """What stops an adapter's files from being read at all, in any dialect: a file missing or pickled, a config
    that is not JSON, a safetensors file that does not parse."""
    problems = _files(Path(adapter))
    if problems:
        return problems
    try:
        json.loads((Path(adapter) / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        problems.append(Problem("format", CONFIG_FILE, f"not JSON: {exc}"))
    return problems + _tensors(Path(adapter))[1]


def marker_beside_invalid(adapter: Path, base: Path, marker: str | None) -> list[Problem]:
    """A success marker that certifies an invalid adapter (or none): ``[]`` when there is no marker."""
    if marker is None or not (Path(adapter) / marker).exists():
        return []
    problems = judge_adapter_dir(adapter, base)
    if not problems:
        return []
    return [Problem("marker", marker, f"present beside an invalid adapter: {problems[0]}")]


__all__ = [
    "ADAPTER_FILE",
    "CONFIG_FILE",
    "Expected",
    "PEFT_PREFIX",
    "Problem",
    "TRANSFORMERS_LEAF",
    "base_weight_shapes",
    "judge_adapter_dir",
    "main_target_module",
    "marker_beside_invalid",
    "marker_missing",
    "read_header",
    "transformers_modules",
    "unreadable",
]
