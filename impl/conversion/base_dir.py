"""A base checkpoint directory as the header-only commands read it, every problem named by its file.

:func:`inspect_base` lists what is wrong; :func:`read_base_dir` raises the first problem as its typed error. Whether
the config is DeepSeek-V4 comes first: every later finding is moot on another architecture. It reads headers only,
so a full-size base is cheap, and it needs plain Python and safetensors, never megatron."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from impl.conversion.detect import V4_ARCHITECTURE, is_deepseek_v4_config, is_deepseek_v41_config, v41_problem
from impl.conversion.layouts import DESCRIPTION, BaseLayout, read_as_official
from impl.errors import (
    ConfigFileError,
    CorruptCheckpointError,
    DeepseekV41UnsupportedError,
    Dsv4Error,
    InputFileError,
    NotDeepseekV4Error,
    ShardIndexError,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
#: config.json keys every header-level check needs (the shapes of the attention projections follow from them)
REQUIRED_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
_LISTED = 5  # names listed per problem


class Problem(NamedTuple):
    error: type[Dsv4Error]
    message: str


class TensorHeader(NamedTuple):
    shape: list[int]
    dtype: str
    file: str
    stored: str | None = None  # the name in the file, where the layout is not the official one


@dataclass
class BaseDir:
    """What was read: the parsed config (None when unreadable), each tensor's header, and every problem."""

    path: Path
    config: dict[str, Any] | None = None
    headers: dict[str, TensorHeader] = field(default_factory=dict)  # by official name
    problems: list[Problem] = field(default_factory=list)
    layout: BaseLayout = BaseLayout.OFFICIAL  # the naming the files use (headers are translated from it)

    @property
    def layout_note(self) -> str:
        """The layout, for a report line ("" for the official one)."""
        if self.layout is BaseLayout.OFFICIAL:
            return ""
        return f"{self.layout} layout (written by save_pretrained; no MTP)"

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_first(self) -> BaseDir:
        """``self`` when there is no problem; else raise the first, typed."""
        if self.problems:
            raise self.problems[0].error(self.problems[0].message)
        return self


def read_json_object(file: Path, *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON config file as a dict, or :class:`ConfigFileError` / :class:`InputFileError` naming the file, what
    is wrong and (for a missing key) which key."""
    if not file.exists():
        raise ConfigFileError(f"{file}: missing")
    try:
        value = json.loads(file.read_bytes())
    except OSError as exc:
        raise InputFileError(f"{file}: unreadable ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigFileError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigFileError(f"{file}: a JSON {type(value).__name__}, expected an object")
    missing = [k for k in required if k not in value]
    if missing:
        raise ConfigFileError(f"{file}: missing key(s) {', '.join(missing)}")
    return value


def architectures_problem(file: Path, config: dict[str, Any]) -> str:
    """``<file>: architectures=[DeepseekV3ForCausalLM], not DeepSeek-V4 (...)``."""
    archs = config.get("architectures")
    shown = f"[{', '.join(map(str, archs))}]" if isinstance(archs, list) else repr(archs)
    return (
        f"{file}: architectures={shown}, not DeepSeek-V4 (model_type={config.get('model_type')!r}); this tool "
        f"handles {V4_ARCHITECTURE} only"
    )


def _directory(base: BaseDir) -> Iterator[Problem]:
    if not base.path.exists():
        yield Problem(InputFileError, f"{base.path}: no such directory")
    elif not base.path.is_dir():
        yield Problem(InputFileError, f"{base.path}: not a directory")


def _config(base: BaseDir) -> Iterator[Problem]:
    file = base.path / CONFIG_FILE
    try:
        config = read_json_object(file)
    except InputFileError as exc:
        yield Problem(type(exc), str(exc))
        return
    base.config = config
    if is_deepseek_v41_config(config):
        yield Problem(DeepseekV41UnsupportedError, f"{file}: {v41_problem(config)}")
        return
    if not is_deepseek_v4_config(config):
        yield Problem(NotDeepseekV4Error, architectures_problem(file, config))
        return
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        yield Problem(ConfigFileError, f"{file}: missing key(s) {', '.join(missing)}")


def _transformers_config(base: BaseDir) -> Iterator[Problem]:
    """``config.json`` as transformers reads it (what coverage, qualify and the ranks build from)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(base.path))
    except Exception as exc:  # transformers' validators raise several types; each is a finding about this file
        first = str(exc).strip().splitlines() or [type(exc).__name__]
        yield Problem(ConfigFileError, f"{base.path / CONFIG_FILE}: transformers rejects it ({' '.join(first[:2])})")


def _index(base: BaseDir) -> dict[str, str] | None:
    """The index's weight map (raises ConfigFileError when the index is there but unusable); None without one."""
    file = base.path / INDEX_FILE
    if not file.exists():
        return None
    weight_map = read_json_object(file, required=("weight_map",))["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigFileError(f"{file}: weight_map must map tensor names to shard file names")
    return weight_map


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _shards(base: BaseDir) -> Iterator[Problem]:
    shards = sorted(p.name for p in base.path.glob("*.safetensors"))
    try:
        weight_map = _index(base)
    except InputFileError as exc:
        yield Problem(type(exc), str(exc))
        weight_map = None
    if not shards:
        yield Problem(CorruptCheckpointError, f"{base.path}: no *.safetensors files; point at a checkpoint directory")
        return
    for shard in shards:
        yield from _header(base, shard)
    if weight_map is None:
        return
    index = base.path / INDEX_FILE
    for shard in sorted(set(weight_map.values()) - set(shards)):
        yield Problem(ShardIndexError, f"{index}: names shard {shard}, which is missing from {base.path}")
    for shard in sorted(set(shards) - set(weight_map.values())):
        yield Problem(ShardIndexError, f"{base.path / shard}: an extra shard that {INDEX_FILE} does not name")
    moved = sorted(n for n, h in base.headers.items() if n in weight_map and weight_map[n] != h.file)
    if moved:
        yield Problem(ShardIndexError, f"{index}: places {_names(moved)} in another shard than the one holding it")
    unlisted = sorted(n for n in base.headers if n not in weight_map)
    if unlisted:
        yield Problem(ShardIndexError, f"{index}: does not list {_names(unlisted)}")
    absent = sorted(n for n, s in weight_map.items() if s in shards and n not in base.headers)
    if absent:
        yield Problem(ShardIndexError, f"{index}: lists {_names(absent)}, absent from the shard it names")


def _header(base: BaseDir, shard: str) -> Iterator[Problem]:
    from impl.conversion.headers import read_file_header  # the one safetensors header reader (plain Python)

    file = base.path / shard
    try:
        found = read_file_header(file)
    except OSError as exc:
        yield Problem(InputFileError, f"{file}: unreadable ({exc.strerror or type(exc).__name__})")
        return
    except CorruptCheckpointError as exc:  # truncated, padded or not a safetensors file: the reader names it
        yield Problem(CorruptCheckpointError, str(exc))
        return
    twice = sorted({name for name, _ in found if name in base.headers})
    if twice:
        yield Problem(CorruptCheckpointError, f"{file}: {_names(twice)} also in {base.headers[twice[0]].file}")
    for name, header in found:
        base.headers.setdefault(name, TensorHeader(list(header.shape), header.dtype, shard))


def _layout(base: BaseDir) -> Iterator[Problem]:
    """A base saved by transformers is read under official names; a name of neither layout is left as it is."""
    layout, official, unknown = read_as_official(base.headers)
    if layout is BaseLayout.OFFICIAL:
        return
    base.layout = layout
    if unknown:
        yield Problem(
            CorruptCheckpointError,
            f"{base.path}: in {DESCRIPTION[layout]}, {len(unknown)} tensor(s) stand for nothing of a DeepSeek-V4 "
            f"base: {_names(sorted(unknown))}",
        )
    base.headers = {name: base.headers[stored]._replace(stored=stored) for name, stored in official.items()}


#: The steps, in order; a step after a failed ``directory`` or ``config`` step would only repeat it.
BASE_STEPS: tuple[tuple[str, Callable[[BaseDir], Iterator[Problem]], bool], ...] = (
    ("directory", _directory, True),
    ("config", _config, True),
    ("shards", _shards, False),
    ("layout", _layout, False),
)


def inspect_base(path: str | Path, *, transformers_config: bool = False) -> BaseDir:
    """Read a base directory's config and headers, listing every problem (never raises on a bad base).
    ``transformers_config``: also have transformers parse ``config.json`` (for commands that build from it; the
    header-only ``verify-adapter`` does not need it).

    It reads ``config.json``, the shard set (``model.safetensors.index.json`` and the ``*.safetensors`` files agree)
    and every shard's safetensors header. The steps, in order:

    | step | problem when |
    |---|---|
    | ``directory`` | the base path does not exist or is not a directory |
    | ``config`` | ``config.json`` missing, unreadable, not a JSON object, not DeepSeek-V4, or lacking a required key |
    | ``transformers_config`` | (when asked) transformers' ``DeepseekV4Config`` rejects a value |
    | ``shards`` | no shard; the index is invalid, names a shard that is absent, or omits one that is present |
    | ``headers`` | a shard is not a readable safetensors file (truncated, corrupt); a tensor sits in two shards, or |
    |  | in another shard than the index says |
    | ``layout`` | (a base written by transformers' ``save_pretrained``: :mod:`impl.conversion.layouts`) a tensor name |
    |  | that stands for nothing of a V4 base; the others are read under their official names |
    """
    base = BaseDir(Path(path))
    steps = list(BASE_STEPS)
    if transformers_config:
        steps.insert(2, ("transformers_config", _transformers_config, True))
    for _, step, blocking in steps:
        found = list(step(base))
        base.problems += found
        if found and blocking:
            break
    return base


def read_base_dir(path: str | Path) -> BaseDir:
    """:func:`inspect_base`, raising the first problem as its typed error (:class:`NotDeepseekV4Error` first)."""
    return inspect_base(path).raise_first()


__all__ = [
    "inspect_base",
    "read_base_dir",
]
