"""sha256 of base tensors, remembered across runs while the shard file is provably unchanged.

A pinned base is hashed again by every adapter checked against it, so digests are reused, as git's index does,
only while the file's identity is what it was when they were taken (:func:`tensor_digests`). The cache is never
required: one that cannot be read or written is passed over. Its entries are as trustworthy as the directory
holding them (:func:`cache_root`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from impl.conversion.headers import Header, tensor_sha256

__all__ = ["RACY_MARGIN_S", "cache_root", "remembered_digests", "tensor_digests"]

RACY_MARGIN_S = 1.0
CACHE_VERSION = 1
#: the cache keeps at most this many shard entries (the least recently written go first)
MAX_ENTRIES = 4096


def cache_root() -> Path | None:
    """The cache directory in use, or None when ``DSV4_LORA_CACHE=off``.

    ``$DSV4_LORA_CACHE``, else ``$XDG_CACHE_HOME/dsv4-lora``, else ``~/.cache/dsv4-lora``. A cache that cannot be
    read or written is passed over: it saves time and is never required. Its entries are as trustworthy as the
    directory holding them (anyone who can write there can plant a digest).
    """
    env = os.environ.get("DSV4_LORA_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4-lora"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _entry_path(root: Path, file: Path) -> Path:
    return root / "digests" / (hashlib.sha256(str(file).encode()).hexdigest()[:32] + ".json")


def _load(entry: Path, identity: list[int]) -> dict[str, str]:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("identity") != identity:
        return {}
    spans = data.get("spans")
    return dict(spans) if isinstance(spans, dict) else {}


def _store(entry: Path, file: Path, identity: list[int], spans: Mapping[str, str]) -> None:
    """Atomically replace the file's entry (tmp + rename); failures are passed over."""
    body = json.dumps({"version": CACHE_VERSION, "file": str(file), "identity": identity, "spans": dict(spans)})
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(body)
        os.replace(tmp, entry)
        _prune(entry.parent)
    except OSError:
        pass


def _prune(folder: Path) -> None:
    entries = list(folder.glob("*.json"))
    if len(entries) <= MAX_ENTRIES:
        return
    for old in sorted(entries, key=lambda p: p.stat().st_mtime_ns)[: len(entries) - MAX_ENTRIES]:
        old.unlink(missing_ok=True)


def _span_key(h: Header) -> str:
    return f"{h.span[0]}-{h.span[1]}"


def _by_file(ckpt_dir: Path, headers: Mapping[str, Header]) -> dict[Path, dict[str, Header]]:
    by_file: dict[Path, dict[str, Header]] = {}
    for name, h in headers.items():
        by_file.setdefault((Path(ckpt_dir) / h.file).resolve(), {})[name] = h
    return by_file


def remembered_digests(ckpt_dir: Path, headers: Mapping[str, Header]) -> dict[str, str]:
    """name -> sha256 (hex) of the tensors whose digests are remembered for their unchanged shard (no byte read)."""
    root = cache_root()
    known: dict[str, str] = {}
    if root is None:
        return known
    for file, names in _by_file(ckpt_dir, headers).items():
        cached = _load(_entry_path(root, file), _identity(file.stat()))
        known.update({n: cached[_span_key(h)] for n, h in names.items() if _span_key(h) in cached})
    return known


def tensor_digests(ckpt_dir: Path, headers: Mapping[str, Header]) -> dict[str, str]:
    """name -> sha256 (hex) of each tensor's stored bytes: remembered ones where the shard is unchanged, the rest
    hashed (several at once: hashlib and file reads release the GIL) and remembered when safe to.

    A base is pinned and read many times: every adapter checked against it hashes the same targeted bytes. As git's
    index does, a shard's digests are reused only while the file's identity is what it was when they were taken:
    device, inode, size, and mtime and ctime in nanoseconds (ctime cannot be set back by a user: every write,
    ``utime`` or rename moves it). Digests of a file whose mtime or ctime is within :data:`RACY_MARGIN_S` of the
    moment it is hashed, or whose identity changes while it is hashed, are never stored (a write in the same
    timestamp tick would otherwise go unseen: git's "racily clean" entries).
    """
    root = cache_root()
    by_file = _by_file(ckpt_dir, headers)
    before = {file: _identity(file.stat()) for file in by_file}
    known = remembered_digests(ckpt_dir, headers)
    todo = {n: h for n, h in headers.items() if n not in known}
    started = time.time_ns()
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        known.update(zip(todo, pool.map(lambda h: tensor_sha256(ckpt_dir, h), todo.values()), strict=True))
    if root is not None and todo:
        for file, names in by_file.items():
            ident = before[file]
            settled = max(ident[3], ident[4]) <= started - int(RACY_MARGIN_S * 1e9)
            if settled and _identity(file.stat()) == ident and any(n in todo for n in names):
                old = _load(_entry_path(root, file), ident)
                _store(_entry_path(root, file), file, ident, old | {_span_key(h): known[n] for n, h in names.items()})
    return {n: known[n] for n in headers}
