"""Bad input never ends in a traceback: every ``dsv4-lora`` command turns it into problem lines naming the file and
what is wrong, and exits 1 (2 for a usage error). A base that is not DeepSeek-V4 is said first. Driven as a user
drives it (subprocesses), on a tiny base sharded in two with its index and an adapter exported against it."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from safetensors.torch import load_file, save_file

from fixtures.data import strategies as hh
from fixtures.data.adapter_states import export_fingerprinted_adapter
from fixtures.runner.subproc import run
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = [pytest.mark.cpu, pytest.mark.xdist_group("bad_input")]
SUBPROCESS = pytest.mark.slow  # each case starts an interpreter that imports torch

PRESET, R = "tiny-mixed", 4
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def shard_base(base: Path) -> None:
    """Split a one-file base into two shards with a ``model.safetensors.index.json``, as large bases ship."""
    (single,) = base.glob("*.safetensors")
    tensors = load_file(single)
    single.unlink()
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    weight_map = {}
    for shard, part in zip(SHARDS, halves, strict=True):
        save_file({n: tensors[n] for n in part}, base / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (base / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def build_pair(impl, root: Path) -> tuple[Path, Path]:
    """A sharded tiny V4 base and a fingerprinted adapter on its five main targets."""
    base = write_checkpoint(PRESET, root / "base", seed=2)
    shard_base(base)
    export_fingerprinted_adapter(impl, base, root / "adapter", get_preset(PRESET), r=R, alpha=8.0)
    return base, root / "adapter"


@pytest.fixture(scope="module")
def pair(impl, tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(impl, tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def dsv4(impl):
    def run_cli(*args, timeout: float = 300):
        return run([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=timeout)

    return run_cli


# ------------------------------------------------------------------------------------------------- damages
def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _v3(doc: dict) -> None:
    doc["architectures"], doc["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"


def _dangling(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "nowhere")


#: case -> (damage(adapter, base), the file the first problem names, what it says)
DAMAGE: dict[str, tuple[Callable[[Path, Path], None], str, str]] = {
    "truncated-adapter-safetensors": (
        lambda a, b: _truncate(a / "adapter_model.safetensors", 1000),
        "adapter_model.safetensors",
        "unreadable",
    ),
    "half-written-adapter-config": (
        lambda a, b: _truncate(a / "adapter_config.json", 100),
        "adapter_config.json",
        "unreadable",
    ),
    "adapter-config-not-an-object": (
        lambda a, b: (a / "adapter_config.json").write_text("[1, 2]"),
        "adapter_config.json",
        "expected an object",
    ),
    "adapter-config-without-r": (
        lambda a, b: _edit_json(a / "adapter_config.json", lambda d: d.pop("r")),
        ".complete",  # the marker notices first that the config is not the certified one
        "stale",
    ),
    "unreadable-adapter-file": (
        lambda a, b: _dangling(a / "adapter_model.safetensors"),
        "adapter",
        "missing adapter_model.safetensors",
    ),
    "truncated-base-shard": (lambda a, b: _truncate(b / SHARDS[1], 5000), SHARDS[1], "not a readable safetensors"),
    "corrupt-base-header": (
        lambda a, b: (b / SHARDS[0]).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
        SHARDS[0],
        "not a readable safetensors",
    ),
    "base-config-invalid-json": (lambda a, b: _truncate(b / "config.json", 50), "config.json", "invalid JSON"),
    "base-config-missing-key": (
        lambda a, b: _edit_json(b / "config.json", lambda d: d.pop("hidden_size")),
        "config.json",
        "missing key(s) hidden_size",
    ),
    "base-config-unreadable": (
        lambda a, b: ((b / "config.json").unlink(), (b / "config.json").mkdir()),
        "config.json",
        "unreadable",
    ),
    "base-not-v4": (
        lambda a, b: _edit_json(b / "config.json", _v3),
        "config.json",
        "architectures=[DeepseekV3ForCausalLM], not DeepSeek-V4",
    ),
    "base-shard-missing": (lambda a, b: (b / SHARDS[1]).unlink(), INDEX, f"names shard {SHARDS[1]}"),
    "base-shard-extra": (
        lambda a, b: shutil.copy(b / SHARDS[1], b / "model-00003-of-00002.safetensors"),
        "model-00003-of-00002.safetensors",
        "",
    ),
    "base-index-invalid": (lambda a, b: _truncate(b / INDEX, 30), INDEX, "invalid JSON"),
    "base-index-without-weight-map": (
        lambda a, b: _edit_json(b / INDEX, lambda d: d.pop("weight_map")),
        INDEX,
        "missing key(s) weight_map",
    ),
    "base-does-not-exist": (lambda a, b: shutil.rmtree(b), "base", "no such directory"),
}
BASE_CASES = sorted(k for k in DAMAGE if k.startswith("base"))


@pytest.fixture
def damaged(pair, tmp_path, request) -> tuple[Path, Path, str, str]:
    damage, file, says = DAMAGE[request.param]
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(pair[0], base)
    shutil.copytree(pair[1], adapter)
    damage(adapter, base)
    return base, adapter, file, says


def _problems(result) -> list[str]:
    return [line.strip().removeprefix("problem: ") for line in result.stdout.splitlines() if "problem: " in line]


def _no_traceback(result, case: str) -> None:
    text = result.stdout + result.stderr
    assert "Traceback" not in text, f"{case}: a traceback instead of a problem line:\n{text[-4000:]}"


@SUBPROCESS
@pytest.mark.parametrize("damaged", sorted(DAMAGE), indirect=True)
def test_verify_adapter_names_the_damaged_file(dsv4, damaged, request):
    base, adapter, file, says = damaged
    case = request.node.callspec.id
    result = dsv4("verify-adapter", "--base", base, "--adapter", adapter)
    _no_traceback(result, case)
    assert result.returncode == 1, f"{case}: exit {result.returncode}\n{result.stdout[-3000:]}"
    problems = _problems(result)
    assert problems, f"{case}: no problem line\n{result.stdout[-3000:]}"
    assert file in problems[0] and says in problems[0], (
        f"{case}: first problem does not name {file!r} / {says!r}:\n" + ("\n".join(problems))
    )


@SUBPROCESS
@pytest.mark.parametrize("damaged", ["base-not-v4", "truncated-base-shard", "base-shard-missing"], indirect=True)
def test_coverage_names_the_damaged_base_file(dsv4, damaged, request):
    base, _, file, says = damaged
    result = dsv4("coverage", "--base", base)
    case = request.node.callspec.id
    _no_traceback(result, case)
    assert result.returncode == 1, f"{case}: exit {result.returncode}\n{result.stdout[-3000:]}"
    problems = _problems(result)
    assert problems and file in problems[0] and says in problems[0], f"{case}: {problems}"


@SUBPROCESS
def test_coverage_names_a_config_value_transformers_rejects(dsv4, pair, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(pair[0], base)
    _edit_json(base / "config.json", lambda d: d.update(num_hidden_layers="four"))
    result = dsv4("coverage", "--base", base)
    _no_traceback(result, "num_hidden_layers='four'")
    problems = _problems(result)
    assert result.returncode == 1 and problems, result.stdout[-3000:]
    assert "config.json" in problems[0] and "num_hidden_layers" in problems[0], problems


@SUBPROCESS
@pytest.mark.parametrize("damaged", ["base-not-v4", "base-shard-missing", "base-config-invalid-json"], indirect=True)
def test_qualify_names_the_damaged_base_file_before_starting_ranks(dsv4, damaged, request, tmp_path):
    base, _, file, says = damaged
    result = dsv4("qualify", "--base", base, "--out", tmp_path / "out", timeout=120)
    case = request.node.callspec.id
    _no_traceback(result, case)
    assert result.returncode == 1, f"{case}: exit {result.returncode}\n{result.stdout[-3000:]}"
    report = json.loads((tmp_path / "out" / "qualify.json").read_text())
    failed = [c for c in report["checks"] if c["passed"] is False]
    assert failed and file in failed[0]["figure"] and says in failed[0]["figure"], f"{case}: {report['checks']}"


#: what the judge's read of a base does not check: transformers' config gives every key a default, so a missing key
#: is the implementation's to name, once its ranks load the base
IMPLEMENTATION_NAMES = ("base-config-missing-key",)


@pytest.mark.parametrize("damaged", [c for c in BASE_CASES if c not in IMPLEMENTATION_NAMES], indirect=True)
def test_the_judges_read_of_a_base_names_the_damaged_file_first(damaged, request):
    """What ``qualify`` runs before any rank starts (``dsv4_conformance.judge.base``), on every damaged base."""
    from dsv4_conformance.judge.base import base_problems

    base, _, file, says = damaged
    problems = [str(p) for p in base_problems(base)]
    assert problems and file in problems[0] and says in problems[0], f"{request.node.callspec.id}: {problems}"


@SUBPROCESS
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("qualify", "--tp", "0"), "--tp: 0 must be positive"),
        (("qualify", "--pp", "two"), "--pp: 'two' is not a number"),
        (("qualify", "--targets", " , "), "names no target"),
        (("qualify", "--tp", "2", "--nproc", "3"), "--nproc 3"),
        (("coverage", "--manifest", "flash", "--limit", "-1"), "--limit: -1 must be non-negative"),
        (("coverage", "--manifest", "nope"), "--manifest 'nope': choose flash, pro or a tiny preset"),
        (("qualify", "--preset", "nope"), "--preset 'nope': choose one of"),
        (("verify-adapter", "--base", "x"), "--adapter"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else None,
)
def test_usage_errors_exit_2_naming_the_argument(dsv4, args, says, tmp_path):
    result = dsv4(*args, "--out", tmp_path / "out") if args[0] == "qualify" else dsv4(*args)
    _no_traceback(result, " ".join(args))
    assert result.returncode == 2, f"{args}: exit {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert says in result.stderr, f"{args}: stderr does not say {says!r}:\n{result.stderr[-2000:]}"


@SUBPROCESS
def test_an_unwritable_out_is_named(dsv4, tmp_path):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "out"
    result = dsv4("qualify", "--out", out)
    _no_traceback(result, "--out under a file")
    assert result.returncode == 1
    problems = _problems(result)
    assert problems and str(out) in problems[0] and "not a writable directory" in problems[0], problems


@pytest.mark.parametrize("damaged", sorted(DAMAGE), indirect=True)
def test_verify_adapter_lists_the_damaged_file_first_in_process(impl, damaged, request):
    base, adapter, file, says = damaged
    problems = impl.verify_adapter(base, adapter).problems
    assert problems and file in problems[0] and says in problems[0], f"{request.node.callspec.id}: {problems}"


@pytest.mark.parametrize("case", BASE_CASES)
def test_the_library_raises_the_first_base_problem_typed(impl, pair, tmp_path, case):
    """``read_base_dir`` (what the commands build on) raises a :class:`Dsv4Error` whose message is the first problem
    ``verify_adapter`` lists; a base that is not DeepSeek-V4 raises :class:`NotDeepseekV4Error`."""
    damage, _, _ = DAMAGE[case]
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(pair[0], base)
    shutil.copytree(pair[1], adapter)
    damage(adapter, base)
    listed = impl.verify_adapter(base, adapter).problems
    want = impl.NotDeepseekV4Error if case == "base-not-v4" else impl.Dsv4Error
    with pytest.raises(want) as info:
        impl.read_base_dir(base)
    assert str(info.value) == listed[0], f"{case}: raised {info.value!r}, listed first {listed[0]!r}"


# ------------------------------------------------------------------------------------------------- property
@pytest.fixture(scope="module")
def pristine(impl, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A base/adapter pair to copy per example, and the sha256 of the adapter files its marker certifies."""
    root = tmp_path_factory.mktemp("pristine")
    _, adapter = build_pair(impl, root)
    return root, {n: _sha256(adapter / n) for n in ("adapter_model.safetensors", "adapter_config.json")}


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@given(damage=hh.dir_damage())
def test_verify_adapter_returns_a_verdict_for_any_damage(impl, pristine, damage):
    """Flipped and truncated bytes, mangled JSON, dropped and added files, other dtypes and shapes, in the adapter,
    the base or both: ``verify_adapter`` returns a verdict naming each problem (no check falls through to the
    last-resort guard), and any change to a certified adapter file fails it."""
    root, certified = pristine
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in ("base", "adapter"):
            shutil.copytree(root / part, work / part, symlinks=True)
        for mutation in damage:
            mutation.apply(work)
        result = impl.verify_adapter(work / "base", work / "adapter")
        changed = [n for n, digest in certified.items() if _sha256(work / "adapter" / n) != digest]
    guarded = [p for p in result.problems if "could not be checked" in p]
    assert not guarded, f"{damage}: a check fell through to the last-resort guard: {guarded}"
    if changed:  # a changed file is never certified: refused, or at most uncertified (its marker gone or spoilt)
        uncertified = any(getattr(c, "status", None) == "UNCERTIFIED" for c in result.checks)
        assert not result.ok or uncertified, f"{damage}: {changed} changed, yet verify_adapter certified it"
