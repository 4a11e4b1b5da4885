"""CI's upstream watch (``scripts/upstream_watch.py``) reads what the lanes run from the files that pin it, and names
exactly the final releases above it: a newer engine release is news in CI's log, never a silent gap."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "upstream_watch.py"


def _watch():
    spec = importlib.util.spec_from_file_location("upstream_watch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lane_versions_are_read_from_every_file_that_pins_them(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "requirements" / "consumers-vllm.txt").write_text("# a comment\nvllm==0.33.0\ntorch==2.13.0+cpu\n")
    (tmp_path / "requirements" / "latest.txt").write_text("torch==2.15.0\nmegatron_core==0.19.2 ; python_version\n")
    (tmp_path / "scripts" / "install.sh").write_text("BRIDGE_PIN=${BRIDGE_PIN:-0.6.2}\n")
    (tmp_path / "tox.ini").write_text("#   tox -e bridge04     bridge 0.4.2 / core 0.17.1: no registration\n")
    lanes = _watch().lane_versions(tmp_path)
    want = {
        "vllm": {"0.33.0"},
        "torch": {"2.13.0", "2.15.0"},
        "megatron-core": {"0.19.2", "0.17.1"},
        "megatron-bridge": {"0.6.2", "0.4.2"},
    }
    assert lanes == {name: {Version(v) for v in versions} for name, versions in want.items()}, lanes


def test_only_final_releases_above_the_newest_lane_are_news():
    available = ["0.35.0rc1", "0.34.0", "0.33.1", "0.33.0", "0.32.0", "not-a-version"]
    assert _watch().newer(available, {Version("0.32.0"), Version("0.33.0")}) == ["0.34.0", "0.33.1"]


def test_every_watched_package_has_a_lane():
    done = subprocess.run([sys.executable, str(SCRIPT), "--offline"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    unpinned = [line for line in done.stdout.splitlines() if "no lane pins it" in line]
    assert not unpinned and len(done.stdout.splitlines()) == len(_watch().WATCHED), done.stdout
