#!/usr/bin/env python
"""Print every release on the package index newer than what the lanes run, for the packages whose releases change
what we judge (the engines, transformers, PEFT, torch, Megatron). Never fails: it is news for whoever reads CI's log.

.venv/bin/python scripts/upstream_watch.py            # one line per package
.venv/bin/python scripts/upstream_watch.py --offline  # what the lanes run, without asking the index

What the lanes run is read from the files that pin it (``requirements/*.txt``, ``scripts/install.sh``'s Bridge pin
and ``tox.ini``'s pin environments); the index is asked through pip (``pip index versions``), so pip's configured
index and mirrors answer. Pre-releases are left out.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
#: the packages watched, as the index spells them
WATCHED = ("vllm", "sglang", "transformers", "peft", "torch", "megatron-core", "megatron-bridge", "nemo-automodel")
_PIN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([0-9][^\s;#]*)", re.M)
_TOX_PINS = {
    "megatron-bridge": re.compile(r"bridge (\d+\.\d+\.\d+)"),
    "megatron-core": re.compile(r"core (\d+\.\d+\.\d+)"),
}


def _version(text: str) -> Version | None:
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


def lane_versions(root: Path = ROOT) -> dict[str, set[Version]]:
    """Package -> every version some lane pins (local tags such as ``+cpu`` dropped)."""
    found: dict[str, set[Version]] = {}
    texts = [p.read_text() for p in sorted((root / "requirements").glob("*.txt"))]
    for text in texts:
        for name, version in _PIN.findall(text):
            if (v := _version(version)) is not None:
                found.setdefault(name.lower().replace("_", "-"), set()).add(v)
    install = (root / "scripts" / "install.sh").read_text()
    bridge = re.search(r"BRIDGE_PIN:-([0-9.]+)", install)
    tox = (root / "tox.ini").read_text() if (root / "tox.ini").exists() else ""
    pinned = {name: pattern.findall(tox) for name, pattern in _TOX_PINS.items()}
    pinned["megatron-bridge"] += [bridge.group(1)] if bridge else []
    for name, versions in pinned.items():
        found.setdefault(name, set()).update(v for text in versions if (v := _version(text)) is not None)
    return found


def newer(available: list[str], running: set[Version]) -> list[str]:
    """The final releases of ``available`` above the newest version the lanes run, newest first."""
    top = max(running)
    out = [(v, text) for text in available if (v := _version(text)) is not None and not v.is_prerelease and v > top]
    return [text for _, text in sorted(out, reverse=True)]


def index_versions(package: str, timeout_s: float = 90) -> list[str] | str:
    """The versions the index lists for ``package``, or why it could not be asked."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", package],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"the index did not answer within {timeout_s:.0f}s"
    hit = re.search(r"Available versions:\s*(.+)", done.stdout)
    if done.returncode or hit is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"pip index versions failed: {last[:200]}"
    return [v.strip() for v in hit.group(1).split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offline", action="store_true", help="print what the lanes run without asking the index")
    args = parser.parse_args()
    lanes = lane_versions()
    for package in WATCHED:
        running = lanes.get(package)
        if not running:
            print(f"upstream: {package}: no lane pins it")
            continue
        ran = ", ".join(str(v) for v in sorted(running))
        if args.offline:
            print(f"upstream: {package}: lanes run {ran}")
            continue
        available = index_versions(package)
        if isinstance(available, str):
            print(f"upstream: {package}: lanes run {ran}; {available}")
            continue
        ahead = newer(available, running)
        news = f"NEWER on the index: {', '.join(ahead)}" if ahead else "nothing newer on the index"
        print(f"upstream: {package}: lanes run {ran}; {news}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
