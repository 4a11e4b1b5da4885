"""A base's tensor digests are remembered across runs only while its shard is provably the same file: a second
fingerprint of an unchanged base reads headers only, and every way a shard can change under the same name (bytes
rewritten in place with the old mtime restored, a copy moved over it, a write just before the hash) is hashed again.
A cache that is broken, unwritable or turned off changes nothing but the time taken."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu

TARGETS = [f"layers.{i}.attn.{leaf}.weight" for i in range(2) for leaf in ("wq_a", "wkv")]
#: a shard whose mtime and ctime are older than this is settled (the cache's stated margin is at most 1 s)
SETTLE_S = 1.1

_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED and isinstance(args[0], (str, os.PathLike)):
        _OPENED.append(os.fspath(args[0]))


sys.addaudithook(_audit)


def _opens_of(shard: Path, call) -> tuple[object, int]:
    """``call()``'s result and how often it opened ``shard`` (every open, through any API: audit events)."""
    _OPENED[:] = ["<recording>"]
    try:
        result = call()
    finally:
        seen, _OPENED[:] = _OPENED[1:], []
    return result, sum(Path(p).resolve() == shard.resolve() for p in seen)


def _write_base(path: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.randn(8, 16, generator=g) for name in TARGETS}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    return path / "model.safetensors"


def _byte_of(shard: Path, name: str) -> int:
    """Offset of the first byte of tensor ``name`` (read from the safetensors header, independently of impl)."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8 : 8 + n])[name]["data_offsets"][0]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DSV4_LORA_CACHE", str(root))
    return root


def test_a_second_fingerprint_of_a_settled_base_reads_its_headers_only(impl, tmp_path, cache):
    shard = _write_base(tmp_path / "base")
    time.sleep(SETTLE_S)
    first, cold = _opens_of(shard, lambda: impl.base_fingerprint(tmp_path / "base", TARGETS))
    second, warm = _opens_of(shard, lambda: impl.base_fingerprint(tmp_path / "base", TARGETS))
    assert second == first, "the remembered digests differ from the hashed ones"
    assert cold - warm >= len(TARGETS), (
        f"the shard was opened {cold}x by the first fingerprint and {warm}x by the second: the second must skip "
        f"one read per tensor ({len(TARGETS)})"
    )


def test_bytes_rewritten_in_place_with_the_old_mtime_restored_are_hashed_again(impl, tmp_path, cache):
    shard = _write_base(tmp_path / "base")
    time.sleep(SETTLE_S)
    recorded = impl.base_fingerprint(tmp_path / "base", TARGETS)
    st = shard.stat()
    with open(shard, "r+b") as fh:
        fh.seek(_byte_of(shard, TARGETS[2]))
        old = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([old[0] ^ 0x40]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(impl.FingerprintMismatchError, match=TARGETS[2].replace(".", r"\.")):
        impl.verify_fingerprint(recorded, tmp_path / "base")


def test_a_copy_moved_over_the_shard_with_the_old_times_is_hashed_again(impl, tmp_path, cache):
    shard = _write_base(tmp_path / "base")
    time.sleep(SETTLE_S)
    recorded = impl.base_fingerprint(tmp_path / "base", TARGETS)
    other = _write_base(tmp_path / "other", seed=1)
    shutil.copystat(shard, other)
    os.replace(other, shard)
    with pytest.raises(impl.FingerprintMismatchError, match=TARGETS[0].replace(".", r"\.")):
        impl.verify_fingerprint(recorded, tmp_path / "base")


def test_a_shard_written_just_before_it_is_hashed_is_never_remembered(impl, tmp_path, cache):
    shard = _write_base(tmp_path / "base")
    os.utime(shard)  # written now, whatever the host's load made of the write's time
    _, first = _opens_of(shard, lambda: impl.base_fingerprint(tmp_path / "base", TARGETS))
    _, second = _opens_of(shard, lambda: impl.base_fingerprint(tmp_path / "base", TARGETS))
    assert first >= len(TARGETS) and second >= len(TARGETS), (
        f"a just-written shard was opened {first}x, then {second}x: fewer than once per tensor ({len(TARGETS)}), "
        "so its digests were remembered"
    )


@pytest.mark.parametrize("broken", ["garbage entries", "a file where the folder should be", "off"])
def test_a_broken_unwritable_or_disabled_cache_changes_nothing_but_time(impl, tmp_path, monkeypatch, broken):
    _write_base(tmp_path / "base")
    time.sleep(SETTLE_S)
    monkeypatch.setenv("DSV4_LORA_CACHE", str(tmp_path / "cache"))
    truth = impl.base_fingerprint(tmp_path / "base", TARGETS)
    if broken == "garbage entries":
        entries = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert entries, "a settled base left nothing in the cache: the test proves nothing"
        for p in entries:
            p.write_text('{"version": 1, "identity": "nonsense", "spans": [1, 2]')
    elif broken == "a file where the folder should be":
        (tmp_path / "blocker").write_text("not a folder")
        monkeypatch.setenv("DSV4_LORA_CACHE", str(tmp_path / "blocker"))
    else:
        monkeypatch.setenv("DSV4_LORA_CACHE", "off")
        monkeypatch.chdir(tmp_path)
    assert impl.base_fingerprint(tmp_path / "base", TARGETS) == truth
    assert impl.base_fingerprint(tmp_path / "base", TARGETS) == truth
    if broken == "off":
        assert not (tmp_path / "off").exists(), "DSV4_LORA_CACHE=off was taken as a folder name"
