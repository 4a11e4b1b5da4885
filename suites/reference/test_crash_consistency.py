"""A machine crash (power loss, not a process kill) mid-write never leaves a state the readers accept wrongly: the
file-system calls of one export, one versioned publication and one training-checkpoint write are recorded from the
real code (strace) and every state a crash may leave under ext4 ``data=ordered`` and under POSIX's weaker promise is
rebuilt and judged by the project's own readers (``fixtures/data/crash_states.py`` states the models and the bound).

Invariants: ``.complete`` never certifies bytes that are not there (``verify_adapter`` accepts every state that
carries a marker); after ``recover_export_dir`` the destination is the old directory intact or the new one complete
(absent or new when there was none); a reader resolving ``current`` always finds a complete version; a training
checkpoint reads as the old or the new one, or is refused with ``TrainingCheckpointError``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter
from fixtures.data.crash_states import MODELS, ModelReport, explore
from fixtures.data.fs_model import snapshot
from fixtures.data.syscall_trace import STRACE, record
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.xdist_group("crash-states"),
    pytest.mark.skipif(STRACE is None, reason="strace is not installed (the recorder of the file-system calls)"),
]

ROOT = Path(__file__).resolve().parents[2]
#: the recorded interpreters import what this one imports (the implementation under test may be a copy elsewhere)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])}
PRESET, R = "tiny-mixed", 4


class Scenario:
    """A base, its fingerprint, and the script one recorded run executes (cwd: the recorded root)."""

    def __init__(self, impl, tmp: Path) -> None:
        self.impl = impl
        self.base = write_checkpoint(PRESET, tmp / "base", seed=2)
        cfg = get_preset(PRESET)
        self.shapes = config_attention_shapes(cfg)
        self.layers = cfg.num_hidden_layers
        names = [f"layers.{i}.attn.{leaf}.weight" for i in range(self.layers) for leaf in self.shapes]
        self.fingerprint = impl.base_fingerprint(self.base, names)

    def state(self, seed: int):
        return self.impl.AdapterState(make_native_adapter(self.shapes, self.layers, R, seed=seed), r=R, alpha=8.0)

    def run(self, root: Path, body: str):
        """Record ``body`` run in a fresh interpreter with ``api`` (the implementation) and ``state(seed)``."""
        script = (
            "import importlib, json, sys\n"
            f"api = importlib.import_module({self.impl.name!r})\n"
            "from fixtures.data.adapter_states import make_native_adapter\n"
            f"shapes = {self.shapes!r}\n"
            f"fingerprint = json.loads({json.dumps(self.fingerprint)!r})\n"
            f"def state(seed):\n    return api.AdapterState(make_native_adapter(shapes, {self.layers}, {R}, "
            f"seed=seed), r={R}, alpha=8.0)\n" + body
        )
        return _record_argv(root, [sys.executable, "-c", script], DSV4_LORA_CACHE="off")


@pytest.fixture(scope="module")
def scenario(impl, tmp_path_factory) -> Scenario:
    return Scenario(impl, tmp_path_factory.mktemp("crash"))


def _files(path: Path) -> dict[str, bytes] | None:
    if not path.is_dir():
        return None
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _verified(scenario: Scenario, adapter: Path) -> list[str]:
    result = scenario.impl.verify_adapter(scenario.base, adapter)
    return [f"verify_adapter on {adapter.name}: {p}" for p in result.problems]


def _explored(ops, before, check: Callable[[Path], list[str]], work: Path) -> list[ModelReport]:
    reports = explore(ops, before, check, work)
    for r in reports:
        print(
            f"{r.model}: {r.crash_points} crash points, {r.states} states, {r.distinct} distinct, "
            f"{len(r.violations)} violations"
        )
    return reports


def _assert_none(reports: list[ModelReport], what: str) -> None:
    found = [v for r in reports for v in r.violations]
    assert not found, f"{what}: {len(found)} crash state(s) break an invariant, first: " + "\n".join(
        str(v) for v in found[:5]
    )


def _destination_check(scenario: Scenario, name: str, old: dict | None, new: dict) -> Callable[[Path], list[str]]:
    def check(state: Path) -> list[str]:
        dest, problems = state / name, []
        if (dest / ".complete").is_file():
            problems += _verified(scenario, dest)
        scenario.impl.recover_export_dir(dest)
        got = _files(dest)
        if got != old and got != new:
            problems.append(f"after recovery {name} is {'absent' if got is None else 'neither the old nor the new'}")
        leftovers = sorted(p.name for p in state.iterdir() if p.name.startswith(f".{name}."))
        if leftovers:
            problems.append(f"recovery left {leftovers}")
        return problems

    return check


@pytest.mark.parametrize("existing", [True, False], ids=["over-an-export", "new-destination"])
def test_no_crash_state_of_an_export_certifies_missing_bytes_or_loses_both_versions(scenario, tmp_path, existing):
    root = tmp_path / "root"
    root.mkdir()
    if existing:
        scenario.impl.export_adapter(scenario.state(1), root / "adapter", base_fingerprint=scenario.fingerprint)
    old = _files(root / "adapter")
    ops, before = scenario.run(root, "api.export_adapter(state(2), 'adapter', base_fingerprint=fingerprint)\n")
    new = _files(root / "adapter")
    check = _destination_check(scenario, "adapter", old, new)
    assert check(_copy(root, tmp_path / "final")) == [], "the finished export fails its own invariants"
    _assert_none(_explored(ops, before, check, tmp_path), "export")


def test_a_reader_of_current_always_finds_a_complete_version(scenario, tmp_path):
    root = tmp_path / "root"
    (root / "pub").mkdir(parents=True)
    scenario.impl.publish_version(scenario.state(1), root / "pub", base_fingerprint=scenario.fingerprint)
    ops, before = scenario.run(
        root, "api.publish_version(state(2), 'pub', keep=1, grace_s=0, base_fingerprint=fingerprint)\n"
    )

    def check(state: Path) -> list[str]:
        try:
            current = scenario.impl.resolve_current(state / "pub")
        except scenario.impl.Dsv4Error as exc:
            return [f"a reader finds no current version: {exc}"]
        return _verified(scenario, current)

    assert check(root) == [], "the finished publication fails its own invariants"
    _assert_none(_explored(ops, before, check, tmp_path), "versioned publication")


def _checkpoint_files(step: int) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(step)
    tensors = {"layers.0.attn.wq_a.lora_A.weight": torch.randn(R, 8, generator=g)}
    state = {"format": "dsv4-lora-training", "version": 1, "step": step, "layout": {}, "lora": {"r": R}}
    return {
        "adapter.safetensors": save(tensors, metadata={"format": "pt"}),
        "optimizer.safetensors": save({"layers.0.attn.wq_a.lora_A.weight/exp_avg": tensors[next(iter(tensors))]}),
        "rng.safetensors": save({"cpu": torch.zeros(4, dtype=torch.uint8)}),
        "trainer_state.json": json.dumps(state).encode(),
    }


def test_a_training_checkpoint_in_any_crash_state_reads_as_old_or_new_or_is_refused(scenario, impl, tmp_path):
    """The checkpoint's writer is the file protocol ``save_training_checkpoint`` publishes with (every rank's part
    gathered in memory first), driven directly: ``publish_files`` under the implementation."""
    root, source = tmp_path / "root", tmp_path / "source"
    root.mkdir()
    for step in (1, 2):
        for name, data in _checkpoint_files(step).items():
            (source / str(step)).mkdir(parents=True, exist_ok=True)
            (source / str(step) / name).write_bytes(data)
    publish = (
        f"from {impl.name}.adapter.files import publish_files\nfrom pathlib import Path\n"
        f"src = Path({str(source)!r}) / sys.argv[1]\n"
        "publish_files('ckpt', {p.name: p.read_bytes() for p in src.iterdir()}, None, kind='dsv4-lora-training')\n"
    )
    argv = [sys.executable, "-c", "import sys\n" + publish]
    subprocess.run([*argv, "1"], cwd=root, check=True, env=ENV)
    ops, before = _record_argv(root, [*argv, "2"])

    def check(state: Path) -> list[str]:
        problems = []
        for stage, recover in (("as left", False), ("after recovery", True)):
            if recover:
                impl.recover_export_dir(state / "ckpt")
            try:
                step = impl.read_training_checkpoint(state / "ckpt").state["step"]
            except impl.TrainingCheckpointError:
                if recover:
                    problems.append("after recovery the checkpoint is refused: neither the old nor the new")
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is an unhandled reader error
                problems.append(f"{stage}: the reader raised {type(exc).__name__}: {exc}")
                continue
            if step not in (1, 2):
                problems.append(f"{stage}: read step {step}, neither the old (1) nor the new (2)")
        return problems

    assert check(_copy(root, tmp_path / "final")) == [], "the finished checkpoint fails its own invariants"
    _assert_none(_explored(ops, before, check, tmp_path), "training checkpoint")


def _record_argv(root: Path, argv: list[str], **env: str):
    """The ops of one recorded run and the tree before it. The recording must be faithful: the tree before plus
    every op is the tree the run left (an empty or misparsed trace fails here, not as "no violation")."""
    before = snapshot(root)
    ops = record(argv, root, env={**ENV, **env})
    replayed = before.copy()
    for op in ops:
        replayed.apply(op)
    after = snapshot(root)
    assert replayed.key() == after.key(), (
        f"the recorded {len(ops)} ops do not rebuild what the run left under {root}: "
        f"{sorted(set(replayed.names) ^ set(after.names)) or 'same names, other bytes'}"
    )
    return ops, before


def _copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to, symlinks=True)
    return to


def test_the_explorer_finds_the_classic_unsynced_rename(tmp_path):
    """Its power, in the same run: write-to-temp + rename with no fsync (the classic bug) must break "old or new"
    under the weak model, and not under ext4-ordered, whose journal keeps the order."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "config.json").write_text('{"v": 1}')
    script = (
        "import os\nopen('config.json.tmp', 'w').write('{\"v\": 2}')\nos.replace('config.json.tmp', 'config.json')\n"
    )
    ops, before = _record_argv(root, [sys.executable, "-c", script])

    def check(state: Path) -> list[str]:
        text = (state / "config.json").read_text() if (state / "config.json").exists() else None
        return [] if text in ('{"v": 1}', '{"v": 2}') else [f"config.json is {text!r}"]

    reports = {r.model: r for r in _explored(ops, before, check, tmp_path)}
    assert [m.name for m in MODELS] == list(reports)
    assert reports["weak-posix"].violations, "the weak model found nothing in an unsynced rename"
    assert not reports["ext4-ordered"].violations, [str(v) for v in reports["ext4-ordered"].violations]
