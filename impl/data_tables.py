"""How the implementation reads its data tables (the TOML files beside the modules that read them): text that is
not TOML, or a table with a key the reader does not know or without one it needs, is the reader's typed error
naming the file and the table, so a mistyped key never silently becomes a default."""

from __future__ import annotations

import tomllib
from collections.abc import Set
from pathlib import Path
from typing import Any

from impl.errors import Dsv4Error

__all__ = ["checked_keys", "read_table_file"]


def read_table_file(path: Path, error: type[Dsv4Error]) -> dict[str, Any]:
    """The TOML document at ``path``; ``error`` (naming the file) where it is not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path.name}: not valid TOML: {e}") from None


def checked_keys(
    entry: Any, where: str, error: type[Dsv4Error], *, required: Set[str], optional: Set[str] = frozenset()
) -> dict[str, Any]:
    """``entry`` itself, once it is a table holding every ``required`` key and no key outside ``required`` and
    ``optional``; else ``error`` naming ``where`` and every unknown and missing key."""
    if not isinstance(entry, dict):
        raise error(f"{where}: not a table")
    unknown, missing = sorted(set(entry) - set(required) - set(optional)), sorted(set(required) - set(entry))
    if unknown or missing:
        raise error(f"{where}: unknown keys {unknown}, missing keys {missing}")
    return entry
