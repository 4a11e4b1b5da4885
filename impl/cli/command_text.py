"""Each command's help and description (``commands.toml`` beside this module: text, not code), and the one way a
command's parser is made from them."""

from __future__ import annotations

import argparse
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

TEXT_FILE = Path(__file__).with_name("commands.toml")


@cache
def _texts() -> dict[str, dict[str, str]]:
    return tomllib.loads(TEXT_FILE.read_text())


def add_command(sub: Any, name: str, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The ``dsv4-lora NAME`` parser, with ``commands.toml``'s help and description (lines joined by one space)."""
    text = _texts()[name]
    return sub.add_parser(name, parents=parents, help=text["help"], description=" ".join(text["description"].split()))
