"""The package versions CI runs the suite under, per lane, and what a run on others is told.

A lane is one environment CI tests; :data:`LANES` says which file pins each.
``suites/reference/test_tested_versions.py`` reads those files and the README's table independently and fails when
this table differs from them. A version found in no lane is not an error: ``qualify`` says so in one line and
records it in its JSON report."""

from __future__ import annotations

from collections.abc import Mapping

_MAIN = {
    "torch": "2.13.0",
    "megatron-core": "0.19.2",
    "megatron-bridge": "0.6.2",
    "transformers": "5.12.1",
    "peft": "0.21.2",
    "safetensors": "0.8.0",
}
#: lane -> package -> version; a lane lists what it changes, the rest is the main lane's
LANES: dict[str, dict[str, str]] = {
    "main": _MAIN,
    "bridge05": {**_MAIN, "megatron-bridge": "0.5.1"},
    "bridge04": {**_MAIN, "megatron-bridge": "0.4.2", "megatron-core": "0.17.1"},
    "device-image": {"torch": "2.11.0", "transformers": "5.17.0", "peft": "0.21.2", "safetensors": "0.8.0"},
    "latest": {**_MAIN, "torch": "2.15.0", "transformers": "5.25.0"},
    "latest-previous": {**_MAIN, "torch": "2.15.0", "transformers": "5.24.0"},
    "latest-bridge": {**_MAIN, "torch": "2.15.0", "transformers": "5.25.0"},
}


def untested_versions(installed: Mapping[str, str]) -> list[str]:
    """One entry per installed package whose version no lane ran, naming the versions CI did run."""
    out = []
    for package, version in sorted(installed.items()):
        ran = sorted({lane[package] for lane in LANES.values() if package in lane})
        if ran and version not in ran:
            out.append(f"{package} {version} (CI ran {', '.join(ran)})")
    return out


def untested_line(installed: Mapping[str, str]) -> str | None:
    """The one line a run on untested versions prints (None when every version was tested)."""
    found = untested_versions(installed)
    if not found:
        return None
    return "note: versions no CI lane ran: " + "; ".join(found) + " (figures may differ; see README's version table)"


__all__ = [
    "LANES",
    "untested_line",
    "untested_versions",
]
