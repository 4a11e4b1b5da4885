"""What CI tests is said, per lane, and a run on anything else is told so in one line.

The lanes' versions are read here from the files that make the environments (``requirements/base.txt``,
``scripts/install.sh``'s Megatron-Bridge pin, the pins ``.ci/run`` runs with ``scripts/pin_overlay.sh``'s core for
each, ``requirements/device-image.txt``, ``requirements/latest.txt``, its Bridge half's ``latest-bridge.txt`` and ``latest-previous.txt``), not from the implementation; the implementation's table and the version table of
``docs/pins_and_lanes.md`` must both say the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors")


def _requirements(name: str) -> dict[str, str]:
    text = (ROOT / "requirements" / name).read_text()
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, flags=re.M))
    return {p: found[p] for p in PACKAGES if p in found}


def _lanes_from_files() -> dict[str, dict[str, str]]:
    main = _requirements("base.txt")
    main["megatron-bridge"] = re.search(r"BRIDGE_PIN:-([0-9.]+)", (ROOT / "scripts/install.sh").read_text())[1]
    overlay = (ROOT / "scripts/pin_overlay.sh").read_text()
    cores = re.findall(r"^\s+([0-9.*]+)\) echo ([0-9.]+) ;;$", overlay, flags=re.M)
    default_core = re.search(r"^\s+\*\) echo ([0-9.]+) ;;$", overlay, flags=re.M)[1]
    lanes = {"main": main}
    for pin in dict.fromkeys(re.findall(r"run scripts/run_pin.sh ([0-9.]+) ", (ROOT / ".ci/run").read_text())):
        core = next(
            (c for pattern, c in cores if re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), pin)), None
        )
        major, minor = pin.split(".")[:2]
        lanes[f"bridge{major}{minor}"] = {**main, "megatron-bridge": pin, "megatron-core": core or default_core}
    lanes["device-image"] = _requirements("device-image.txt")
    if "scripts/run_latest.sh bridge" in (ROOT / ".ci/run").read_text():
        latest = {**_requirements("latest.txt"), "megatron-bridge": main["megatron-bridge"]}
        lanes["latest"] = latest
        lanes["latest-bridge"] = {**latest, **_requirements("latest-bridge.txt")}
    if "scripts/run_latest.sh previous" in (ROOT / ".ci/run").read_text():
        lanes["latest-previous"] = {**lanes["latest"], **_requirements("latest-previous.txt")}
    return lanes


def test_the_lanes_are_the_environments_ci_builds(impl):
    want = _lanes_from_files()
    assert set(want) >= {
        "main",
        "bridge05",
        "bridge04",
        "device-image",
        "latest",
        "latest-bridge",
        "latest-previous",
    }, sorted(want)
    assert impl.LANES == want, f"{impl.name}.LANES differs from what CI installs:\n{impl.LANES}\n{want}"


def test_the_readme_version_table_lists_each_lane(impl):
    readme = (ROOT / "docs" / "pins_and_lanes.md").read_text()
    for lane, versions in _lanes_from_files().items():
        row = f"| {lane} | " + " | ".join(versions.get(p, "-") for p in PACKAGES) + " |"
        assert row in readme, f"docs/pins_and_lanes.md's version table lacks the row {row}"


def test_an_untested_version_is_one_line_naming_it_and_what_ci_ran(impl):
    lanes = _lanes_from_files()
    main = lanes["main"]
    assert impl.untested_line(main) is None, "the main lane's own versions reported untested"
    untested = {"transformers": "5.13.0", "torch": "2.14.0"}
    assert not any(lane.get(p) == v for lane in lanes.values() for p, v in untested.items()), "a lane runs them"
    line = impl.untested_line({**main, **untested})
    assert line is not None and "\n" not in line, line
    assert "transformers 5.13.0 (CI ran " in line and main["transformers"] in line, line
    assert "torch 2.14.0" in line and "megatron" not in line, line
