"""A base directory read as the judge reads it, before any implementation touches it: its config and the headers of
its safetensors files, never the data.

``qualify`` runs this before it starts a rank, so a damaged base is named in a second, by file, and never reaches
an implementation as a puzzle. Nothing here imports an implementation; each problem names the file it is in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4_conformance.judge.artifacts import Problem, read_header

#: the one architecture the contract is about
ARCHITECTURE = "DeepseekV4ForCausalLM"
INDEX = "model.safetensors.index.json"
#: what a V4.1 base is told: another architecture, and how it differs (docs/deepseek_v41.md has the facts)
V41_SAID = (
    "DeepSeek-V4.1: a different architecture, not supported yet (a nested text_config + vision_config, Engram and "
    "DSpark modules, other shapes for the five attention projections: a V4 adapter does not fit it); "
    "docs/deepseek_v41.md"
)


def _json(path: Path) -> tuple[Any, Problem | None]:
    """The file's JSON object, or the problem with it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, Problem("base", path.name, "missing")
    except json.JSONDecodeError as exc:
        return None, Problem("base", path.name, f"invalid JSON ({exc.msg}, line {exc.lineno})")
    except (OSError, UnicodeDecodeError) as exc:
        return None, Problem("base", path.name, f"unreadable ({type(exc).__name__}: {exc.strerror or exc})")
    if not isinstance(data, dict):
        return None, Problem("base", path.name, f"expected an object, found {type(data).__name__}")
    return data, None


def _is_v41(config: dict[str, Any]) -> bool:
    """DeepSeek-V4.1 in a spelling published so far (``tiny_models.v41``), at the top or in its ``text_config``."""
    from tiny_models.v41 import V41_SPELLINGS

    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            names = cfg.get("architectures") or [None]
            if any(names[0] == a or cfg.get("model_type") == t for a, t in V41_SPELLINGS):
                return True
    return False


def _config(base: Path) -> list[Problem]:
    config, problem = _json(base / "config.json")
    if problem:
        return [problem]
    if _is_v41(config):
        return [Problem("detect", "config.json", V41_SAID)]
    names = config.get("architectures")
    if names != [ARCHITECTURE]:
        shown = ",".join(map(str, names)) if isinstance(names, list) else names
        return [Problem("detect", "config.json", f"architectures=[{shown}], not DeepSeek-V4 ({ARCHITECTURE})")]
    return []


def _shards(base: Path) -> tuple[list[Path], list[Problem]]:
    """The shard files: the index's, when there is one (each must exist), else every ``*.safetensors``."""
    present = sorted(base.glob("*.safetensors"))
    if not (base / INDEX).exists():
        return present, [] if present else [Problem("base", str(base), "no *.safetensors file")]
    index, problem = _json(base / INDEX)
    if problem:
        return [], [problem]
    if not isinstance(index.get("weight_map"), dict):
        return [], [Problem("base", INDEX, "missing key(s) weight_map")]
    named = sorted(set(map(str, index["weight_map"].values())))
    problems = [
        Problem("base", INDEX, f"names shard {n}, which is not in the base") for n in named if not (base / n).is_file()
    ]
    problems += [Problem("base", p.name, f"in the base but not in {INDEX}") for p in present if p.name not in named]
    return [base / n for n in named if (base / n).is_file()], problems


def _header_problem(shard: Path) -> Problem | None:
    """None when the header parses and every tensor's bytes lie within the file."""
    try:
        header = read_header(shard)
        with open(shard, "rb") as f:
            room = shard.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return Problem("base", shard.name, f"not a readable safetensors file ({type(exc).__name__}: {exc})")
    if end > room:
        return Problem(
            "base", shard.name, f"not a readable safetensors file (truncated: {end} data bytes, {room} left)"
        )
    return None


def base_problems(base: str | Path) -> list[Problem]:
    """What keeps ``base`` from being a DeepSeek-V4 checkpoint one can load, first problem first; [] when none. A
    config that is not DeepSeek-V4's is ``detect``'s problem, every other ``base``'s."""
    base = Path(base)
    if not base.is_dir():
        return [Problem("base", f"base {base}", "no such directory")]
    problems = _config(base)
    if problems:
        return problems
    shards, problems = _shards(base)
    return problems + [p for p in map(_header_problem, shards) if p]


#: the layouts a base comes in, by a name every tensor of a layer has: (prefix, what the layout is called)
LAYOUTS = (
    ("model.layers.0.self_attn.", "transformers layout (save_pretrained)"),
    ("model.layers.0.attn.", "transformers-checkpoint layout (save_pretrained)"),
    ("layers.0.attn.", "official layout"),
)


def base_layout(base: str | Path) -> str:
    """The layout the base's tensor names are in, and whether it has an MTP block: what ``qualify`` says it read."""
    from dsv4_conformance.judge.artifacts import base_weight_shapes

    names = base_weight_shapes(Path(base))
    layout = next((said for prefix, said in LAYOUTS if any(n.startswith(prefix) for n in names)), "unknown layout")
    mtp = any(n.startswith(("mtp.", "model.mtp.")) for n in names)
    return f"{layout}, {'with' if mtp else 'no'} MTP"
