"""Full-size bases: ``verify-adapter`` and ``coverage`` judge a DeepSeek-V4-Flash checkpoint by its headers.

The base is the Flash manifest as a sharded checkpoint of sparse files (``fixtures/data/sparse_checkpoint.py``: real
headers, FP8 scale companions, MXFP4 experts, the index, the published ``config.json``; ~160 GB on paper, a few MB on
disk); the adapter is a Flash-size rank-16 LoRA of the five main projections of all 43 layers. Each command runs as a
user runs it, in a fresh interpreter; these tests judge what it answers. How long it takes and how much memory it
holds is the benchmark's business (``suites/reference/test_bench_full_size_base.py`` states the goals and prints the figures),
because a shared, loaded host decides those, not the code. The figures of every run are printed here too (``-s``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.data.sparse_checkpoint import SparseFlash, poked_copy
from fixtures.runner.subproc import run_measured

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

TIMEOUT_S = 300.0  # a hang guard only, far above any run's duration: speed is the benchmark's to judge


def _dsv4(impl, *args) -> subprocess.CompletedProcess[str]:
    """Run a command of the implementation under test as a user does; print what it cost."""
    result, usage = run_measured([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=TIMEOUT_S)
    print(f"\n{args[0]}: {usage}")
    return result


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_the_sparse_flash_base_is_full_size_in_its_headers_and_tiny_on_disk(flash_sparse: SparseFlash) -> None:
    index = json.loads((flash_sparse.base / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in flash_sparse.base.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards, "the index and the shard files disagree"
    assert len(index["weight_map"]) == flash_sparse.tensors
    assert index["metadata"]["total_size"] == flash_sparse.logical_bytes > 150e9, "not a Flash-size base"
    assert sum((flash_sparse.base / s).stat().st_size for s in shards) > flash_sparse.logical_bytes
    for root in (flash_sparse.base, flash_sparse.adapter):
        assert _disk_bytes(root) < 64e6, f"{root}: {_disk_bytes(root) / 1e6:.0f} MB on disk; the data must be holes"


def test_verify_adapter_passes_a_flash_size_adapter_against_its_flash_size_base(
    impl, flash_sparse: SparseFlash
) -> None:
    result = _dsv4(impl, "verify-adapter", "--base", flash_sparse.base, "--adapter", flash_sparse.adapter)
    assert result.returncode == 0, f"verify-adapter failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stdout + result.stderr


def test_coverage_maps_every_tensor_of_a_flash_base(impl, flash_sparse: SparseFlash) -> None:
    result = _dsv4(impl, "coverage", "--base", flash_sparse.base)
    assert result.returncode == 0, f"coverage found gaps:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    totals = [line for line in result.stdout.splitlines() if line.startswith("totals")][-1]
    figures = {k: int(v) for k, v in re.findall(r"(mapped|declared_not_loaded|unmapped|missing)\D+?(\d+)", totals)}
    scales = sum(
        1
        for name in json.loads((flash_sparse.base / "model.safetensors.index.json").read_text())["weight_map"]
        if name.endswith(".scale")
    )
    assert figures == {
        "mapped": flash_sparse.tensors - scales,
        "declared_not_loaded": scales,
        "unmapped": 0,
        "missing": 0,
    }, f"coverage totals of the Flash base: {totals}"


def test_a_full_hash_is_remembered_and_later_verifies_compare_every_byte(
    impl, flash_sparse: SparseFlash, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling is for a base's first check only: once ``--full-hash`` has hashed a settled base, a plain verify
    compares every targeted tensor by its remembered digest."""
    monkeypatch.setenv("DSV4_LORA_CACHE", str(tmp_path / "cache"))
    newest = max(p.stat().st_mtime for p in flash_sparse.base.iterdir())
    time.sleep(max(0.0, newest + 1.1 - time.time()))  # a shard written within a second is never remembered
    args = ("verify-adapter", "--base", flash_sparse.base, "--adapter", flash_sparse.adapter)
    assert _dsv4(impl, *args, "--full-hash").returncode == 0
    later = _dsv4(impl, *args)
    line = next((x for x in later.stdout.splitlines() if x.lstrip().startswith("fingerprint")), "")
    with open(flash_sparse.adapter / "adapter_model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    recorded = len(json.loads(header["__metadata__"]["dsv4_base_fingerprint"])["tensors"])
    assert later.returncode == 0 and f"every byte of {recorded} tensors" in line, line


@pytest.mark.parametrize("at", [0, -1], ids=["first-byte", "last-byte"])
def test_a_changed_byte_in_a_sampled_page_fails_a_bases_first_verify(
    impl, flash_sparse: SparseFlash, tmp_path: Path, at: int
) -> None:
    """A base's first verify compares each large targeted weight by its sampled pages (docs/fingerprint.md: the
    first and the last page among them); one changed byte in one of them is a mismatch, named."""
    tensor = "layers.42.attn.wo_b.weight"
    poked_copy(flash_sparse.base, tmp_path / "base", tensor, at=at)
    result = _dsv4(impl, "verify-adapter", "--base", tmp_path / "base", "--adapter", flash_sparse.adapter)
    out = result.stdout + result.stderr
    assert result.returncode == 1, f"verify-adapter accepted a base with a changed {tensor}:\n{out[-3000:]}"
    assert tensor in out, f"the fingerprint problem does not name {tensor}:\n{out[-3000:]}"
    assert "Traceback" not in out


def test_a_changed_byte_between_the_samples_fails_the_full_hash_and_the_sampled_verify_says_so(
    impl, flash_sparse: SparseFlash, tmp_path: Path
) -> None:
    """Reading headers for everything else must not cost ``--full-hash`` its bytes: one changed byte outside every
    sampled page is a mismatch, named. Without it the first verify cannot see that byte, and its fingerprint line
    says it compared by samples and how to compare every byte."""
    tensor = "layers.42.attn.wo_b.weight"
    poked_copy(flash_sparse.base, tmp_path / "base", tensor, at=12345)  # between the first two sampled pages
    args = ("verify-adapter", "--base", tmp_path / "base", "--adapter", flash_sparse.adapter)
    sampled = _dsv4(impl, *args)  # first: a full hash is remembered, and a remembered digest is compared whole
    line = next((x for x in sampled.stdout.splitlines() if x.lstrip().startswith("fingerprint")), "")
    assert "sampled pages" in line and "--full-hash" in line, f"the fingerprint line hides the sampling: {line!r}"
    full = _dsv4(impl, *args, "--full-hash")
    out = full.stdout + full.stderr
    assert full.returncode == 1, f"verify-adapter --full-hash accepted a base with a changed {tensor}:\n{out[-3000:]}"
    assert tensor in out and "Traceback" not in out, f"the fingerprint problem does not name {tensor}:\n{out[-3000:]}"
