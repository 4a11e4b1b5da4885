"""Publication to disk while a server reads: versioned immutable directories, one pointer.

``impl.publish_version`` exports each version to its own directory and then points ``root/current`` at it;
``impl.resolve_current`` is the one resolution a reader makes. Proven here: a reader process loading in a loop
with stock PEFT during 100 publications never pairs two versions' files nor reads a partial one; retention keeps
the newest K and every version that was current within the grace (derived below from the publication times); a
publisher SIGKILLed at each step of the pointer protocol leaves ``current`` at a complete version, and the next
publication clears what it left.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.data.adapter_states import make_native_adapter
from fixtures.ranks.faults import kill_on_call
from fixtures.runner.multirank import impl_preload, run_ranks

pytestmark = pytest.mark.cpu

SHAPES = {"wq_a": (48, 64), "wkv": (32, 64), "wo_b": (64, 32)}
LAYERS, R = 2, 4
REPO = Path(__file__).resolve().parents[2]


def _version_state(impl, version: int):
    """Version ``version``'s adapter, its files tied together: lora_alpha = version = every lora_B's first value."""
    tensors = make_native_adapter(SHAPES, LAYERS, R, seed=version)
    for name, t in tensors.items():
        if "linear_out" in name:
            t.reshape(-1)[0] = float(version)
    return impl.AdapterState(tensors, r=R, alpha=float(version))


def test_a_reader_loading_in_a_loop_never_pairs_two_versions_or_reads_a_partial_file(impl, tmp_path):
    root = tmp_path / "published"
    out = tmp_path / "reader.json"
    reader = subprocess.Popen(
        [sys.executable, str(REPO / "fixtures" / "data" / "version_reader.py"), "--root", str(root), "--out", str(out)],
        cwd=REPO,
    )
    try:
        impl.publish_version(_version_state(impl, 1), root, keep=3, grace_s=5.0)
        deadline = time.monotonic() + 120
        while not (root / ".reader-ready").exists() and reader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for version in range(2, 101):
            impl.publish_version(_version_state(impl, version), root, keep=3, grace_s=5.0)
    finally:
        root.mkdir(parents=True, exist_ok=True)
        (root / ".stop").touch()
        reader.wait(timeout=120)
    got = json.loads(out.read_text())
    assert got["problems"] == [], f"the reader saw torn or partial versions: {got['problems']}"
    assert got["loads"] >= 10 and len(got["versions"]) >= 3, (
        f"the reader loaded {got['loads']} times, {len(got['versions'])} versions: too few to prove anything"
    )
    assert impl.resolve_current(root).name == "v00000100", impl.resolve_current(root)


@pytest.mark.xdist_group("consumers")
@pytest.mark.consumer_env
def test_vllm_loading_in_a_loop_never_pairs_two_versions_or_reads_a_partial_file(impl, tmp_path):
    """vLLM 0.33's own directory loader (``PEFTHelper.from_local_dir`` + ``LoRAModel.from_local_checkpoint`` with
    the V4 model's mapper; ``fixtures/consumers/probe_vllm_reader.py`` in its environment) during 100 publications
    in the dialect vLLM loads."""
    from fixtures.consumers import HERE, require_consumer_env, start_probe_script

    require_consumer_env("vllm")
    root, out = tmp_path / "published", tmp_path / "vllm-reader.json"
    impl.publish_version(_version_state(impl, 1), root, keep=3, grace_s=5.0, dialect="official")
    reader = start_probe_script(
        "vllm", HERE / "probe_vllm_reader.py", ["--root", str(root), "--out", str(out)], tmp_path
    )
    try:
        deadline = time.monotonic() + 300
        while not (root / ".vllm-reader-ready").exists() and reader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for version in range(2, 101):
            impl.publish_version(_version_state(impl, version), root, keep=3, grace_s=5.0, dialect="official")
    finally:
        (root / ".stop").touch()
        _, err = reader.communicate(timeout=120)
    assert out.exists(), f"the vLLM reader wrote no report (exit {reader.returncode}): {err[-2000:]}"
    got = json.loads(out.read_text())
    assert got["problems"] == [], f"vLLM loaded torn or partial versions: {got['problems']}"
    assert got["loads"] >= 10 and len(got["versions"]) >= 3, (
        f"vLLM loaded {got['loads']} times, {len(got['versions'])} versions: too few to prove anything"
    )


def test_retention_keeps_the_newest_k_and_every_version_current_within_the_grace(impl, tmp_path):
    """Version v is published at time v and stops being current at v + 1. Publishing version 8 (time 8) with
    keep=2 and grace 2.5 keeps 7 and 8 (the newest two), and 6 and 5 (current until 7 and 6, within 2.5 of 8);
    4 and older go (current until 5 or earlier)."""
    root = tmp_path / "published"
    for version in range(1, 9):
        impl.publish_version(_version_state(impl, version), root, keep=2, grace_s=2.5, clock=lambda v=version: v)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == [f"v{v:08d}" for v in (5, 6, 7, 8)]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".trash")], "a deleted version left a trash dir"


#: (what was done when the publisher died, the call it died before, which of its calls)
KILL_POINTS = {
    "inside-the-export": ("replace", lambda n, a: ".dsv4-staging" in str(a[0])),
    "export-committed-no-link-yet": ("symlink", lambda n, a: True),
    "link-made-not-renamed-in": ("replace", lambda n, a: str(a[0]).endswith(".current.tmp")),
    "link-renamed-in-history-not-written": ("replace", lambda n, a: str(a[0]).endswith(".history.json.tmp")),
    "retention-moving-a-version-out": ("replace", lambda n, a: Path(a[1]).name.startswith(".trash-")),
    "retention-deleting-a-version": ("rmtree", lambda n, a: Path(a[0]).name.startswith(".trash-")),
}


def _publish_and_die(impl, root, point: str) -> None:
    attr, when = KILL_POINTS[point]
    with kill_on_call(shutil if attr == "rmtree" else os, attr, when=when):
        impl.publish_version(_version_state(impl, 3), root, keep=1, grace_s=0.0)
    os._exit(0)  # reached only if the kill point was never called


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_publisher_killed_at_any_step_leaves_a_complete_current_version(impl, tmp_path, point):
    root = tmp_path / "published"
    for version in (1, 2):
        impl.publish_version(_version_state(impl, version), root, keep=2, grace_s=0.0)
    child = multiprocessing.get_context("fork").Process(target=_publish_and_die, args=(impl, root, point))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -9, f"{point}: the publisher was not killed there (exit {child.exitcode})"
    current = impl.resolve_current(root)
    assert current.name in ("v00000002", "v00000003"), f"{point}: current is {current.name}"
    impl.validate_adapter_dir(current)  # complete: marker, hashes, tensors
    config = json.loads((current / "adapter_config.json").read_text())
    assert config["lora_alpha"] == int(current.name[1:]), f"{point}: {current.name} holds {config['lora_alpha']}"
    impl.publish_version(_version_state(impl, 4), root, keep=1, grace_s=0.0)
    config = json.loads((impl.resolve_current(root) / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 4, f"{point}: the next publication is not current ({config['lora_alpha']})"
    leftovers = [p.name for p in root.iterdir() if p.name.startswith((".trash", ".current.tmp", ".v"))]
    assert leftovers == [], f"{point}: the next publication left {leftovers}"


def _current_alpha(impl, root) -> int:
    """The version the current pointer resolves to, as its own files say (lora_alpha = version)."""
    return int(json.loads((impl.resolve_current(root) / "adapter_config.json").read_text())["lora_alpha"])


def _versions_on_disk(root) -> list[int]:
    """The published versions as a reader sees them: the ``vNNNNNNNN`` directories under ``root``."""
    return sorted(int(p.name[1:]) for p in Path(root).iterdir() if p.is_dir() and p.name[1:].isdigit())


def test_a_link_left_by_a_killed_publisher_never_blocks_the_next_publication(impl, tmp_path):
    """A publisher killed after making its new link but before renaming it in leaves ``.current.tmp``; the next
    publication replaces it, even where the version it pointed at is gone since (a dangling link)."""
    root = tmp_path / "published"
    impl.publish_version(_version_state(impl, 1), root)
    for target in ("v00000001", "v00000099"):  # a version that exists, one that does not
        os.symlink(target, root / ".current.tmp")
        number = len(_versions_on_disk(root)) + 1
        impl.publish_version(_version_state(impl, number), root)
        assert _current_alpha(impl, root) == number, f"after a leftover link to {target}: not the new version"


@pytest.mark.parametrize("keep", [1, 2])
def test_retention_without_a_grace_keeps_exactly_the_newest_k(impl, tmp_path, keep):
    """With no grace, nothing but the newest ``keep`` versions (the current one among them) stays published, and a
    root whose folders do not exist yet is made."""
    root = tmp_path / "runs" / "job" / "published"
    for version in range(1, 5):
        impl.publish_version(_version_state(impl, version), root, keep=keep, grace_s=0.0, clock=lambda v=version: v)
    kept = _versions_on_disk(root)
    assert kept == list(range(5 - keep, 5)), f"keep={keep}, no grace: versions {kept} stay"
    assert _current_alpha(impl, root) == 4, "the newest version is not current"


def test_keeping_no_version_is_refused_before_anything_is_published(impl, tmp_path):
    """``keep=0`` would retain nothing, not even the current version: refused, and nothing is written."""
    root = tmp_path / "published"
    with pytest.raises(impl.PublishedVersionError, match="keep=0"):
        impl.publish_version(_version_state(impl, 1), root, keep=0)
    assert not root.exists(), f"a refused publication wrote {sorted(p.name for p in root.iterdir())}"


@dataclass(frozen=True)
class TwoRankCase:
    impl_name: str
    root: str
    writer: int


#: audit events that change the file system, and which of their arguments are paths
_CHANGES = {
    "os.mkdir": 1,
    "os.rename": 2,
    "os.replace": 2,
    "os.symlink": 2,
    "os.remove": 1,
    "os.rmdir": 1,
    "shutil.rmtree": 1,
    "os.chmod": 1,
    "os.truncate": 1,
}


def rank_publish_three_versions(rank: int, world_size: int, case: TwoRankCase) -> dict:
    """Publish three versions collectively with ``writer_rank=case.writer``; record every change this rank makes
    under the root (audit hooks: opening for writing, making, renaming, linking, removing)."""
    from fixtures.runner.impl_loader import load_impl

    impl = load_impl(case.impl_name)
    root, touched = os.path.abspath(case.root), []

    def under_root(value) -> bool:
        return isinstance(value, str | bytes | os.PathLike) and os.path.abspath(os.fsdecode(value)).startswith(root)

    def audit(event: str, args: tuple) -> None:
        if event == "open" and len(args) > 1 and isinstance(args[1], str) and set(args[1]) & set("wax+"):
            paths = args[:1]
        elif event == "open" and len(args) > 2 and isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR):
            paths = args[:1]
        else:
            paths = args[: _CHANGES.get(event, 0)]
        touched.extend(f"{event} {os.fsdecode(a)}" for a in paths if under_root(a))

    sys.addaudithook(audit)
    outs = [
        impl.publish_version(_version_state(impl, v), root, keep=1, grace_s=0.0, writer_rank=case.writer).name
        for v in (1, 2, 3)
    ]
    return {"outs": outs, "touched": touched}


@pytest.mark.multirank
@pytest.mark.parametrize("writer", [0, 1])
def test_on_two_ranks_only_the_writer_touches_the_published_root(impl, tmp_path, writer):
    """A collective publication on two ranks: both return the same versions, and only ``writer_rank`` creates,
    renames, links or deletes anything under the root (the other rank only takes part in the export's collectives)."""
    root = tmp_path / "published"
    results = run_ranks(
        rank_publish_three_versions,
        TwoRankCase(impl.name, str(root), writer),
        nproc=2,
        timeout_s=120,
        preload=impl_preload(impl.name),
    )
    ours, peer = results[writer].payload, results[1 - writer].payload
    assert ours["outs"] == peer["outs"] == ["v00000001", "v00000002", "v00000003"], (ours["outs"], peer["outs"])
    assert ours["touched"], "the writer's audit saw nothing: the test proves nothing"
    assert peer["touched"] == [], (
        f"rank {1 - writer}, not the writer, changed the published root: {peer['touched'][:6]}"
    )
    assert _versions_on_disk(root) == [3] and _current_alpha(impl, root) == 3, _versions_on_disk(root)
