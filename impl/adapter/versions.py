"""Publication to disk while a server reads: versioned immutable adapter directories and one pointer.

Each version is an ordinary export, never written again; ``root/current`` points at the newest only after its export
committed. A reader must resolve the pointer once (:func:`resolve_current`) and read every file from that directory,
so it never pairs two versions' files; point a serving engine at the resolved directory. A publisher killed at any
point leaves ``current`` at a complete version. Layout, swap and retention: :func:`publish_version`."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from impl.adapter.export import export_adapter
from impl.adapter.files import fsync_path
from impl.errors import PublishedVersionError

__all__ = [
    "POINTER",
    "publish_version",
    "resolve_current",
    "version_dirs",
]

POINTER = "current"
HISTORY = ".history.json"
_VERSION = re.compile(r"v(\d{8})")
_LINK_TMP = f".{POINTER}.tmp"


def version_dirs(root: str | os.PathLike) -> dict[int, Path]:
    """The published version directories under ``root``, by number."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {int(m[1]): p for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir()}


def resolve_current(root: str | os.PathLike) -> Path:
    """The current version's directory, resolved once: read every file of one load from it."""
    link = Path(root) / POINTER
    if not link.is_symlink():
        raise PublishedVersionError(f"{link}: no current version published (not a link); publish one first")
    target = Path(os.path.realpath(link))
    if not target.is_dir():
        raise PublishedVersionError(f"{link} points at {target}, which does not exist")
    return target


def _swap_pointer(root: Path, name: str) -> None:
    tmp = root / _LINK_TMP
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, root / POINTER)
    fsync_path(root)


def _history(root: Path) -> dict[str, float | None]:
    try:
        return dict(json.loads((root / HISTORY).read_text()))
    except (OSError, ValueError):
        return {}


def _write_history(root: Path, history: dict[str, float | None]) -> None:
    tmp = root / (HISTORY + ".tmp")
    tmp.write_text(json.dumps(history, sort_keys=True))
    os.replace(tmp, root / HISTORY)


def _retain(root: Path, current: str, keep: int, grace_s: float, now: float) -> list[str]:
    """Delete what retention allows (see :func:`publish_version`); the names deleted."""
    history = _history(root)
    for name, until in list(history.items()):
        if name != current and until is None:
            history[name] = now  # superseded by this publication
    history[current] = None
    versions = sorted(version_dirs(root).items())
    newest = {p.name for _, p in versions[-keep:]} | {current}
    deleted = []
    for _, path in versions:
        until = history.get(path.name, now)
        if path.name in newest or until is None or now - until < grace_s:
            continue
        trash = root / f".trash-{path.name}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        history.pop(path.name, None)
        deleted.append(path.name)
    _write_history(root, {n: t for n, t in history.items() if (root / n).is_dir()})
    return deleted


def _clear_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(".trash-"):
            shutil.rmtree(p, ignore_errors=True)


def publish_version(
    adapter_phase: Any,
    root: str | os.PathLike,
    *,
    keep: int = 3,
    grace_s: float = 300.0,
    writer_rank: int = 0,
    clock: Callable[[], float] = time.time,
    **options: Any,
) -> Path:
    """Collective (as :func:`impl.export_adapter`, whose arguments it takes): export the adapter as the next version
    under ``root``, then point ``root/current`` at it and apply retention; returns the version's directory.

    ``root/v00000007`` is an ordinary export (:func:`impl.export_adapter`: staging, fsync, rename, ``.complete``
    last) that is never written again; ``root/current`` is a symbolic link to the newest one, replaced atomically (a
    new link beside it, renamed over it, the directory fsynced) only after that export committed. A reader resolves
    the link ONCE (:func:`resolve_current`: ``os.path.realpath``) and reads every file from the directory it got, so
    it can never pair one version's ``adapter_config.json`` with the next version's weights; a reader that opens
    ``root/current/...`` file by file across a swap can.

    Retention keeps the newest ``keep`` versions and the current one, and deletes an older version only when it
    stopped being current at least ``grace_s`` seconds ago (``root/.history.json``), so a reader that resolved it
    while it was current has that long to finish loading. A deleted version is renamed out of the ``v*`` names
    first, so no reader can resolve a half-deleted directory. A publisher killed at any point leaves ``current`` at
    a complete version (the previous one, or the new one once its link is renamed in); leftovers are cleared by the
    next publication.
    """
    if keep < 1:
        raise PublishedVersionError(f"keep={keep}: keep at least the current version")
    root = Path(os.path.abspath(root))
    import torch.distributed as dist

    writer = (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0) == writer_rank
    if writer:
        root.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(root)
    number = max(version_dirs(root), default=0) + 1
    out = export_adapter(adapter_phase, root / f"v{number:08d}", writer_rank=writer_rank, **options)
    if writer:
        _swap_pointer(root, out.name)
        _retain(root, out.name, keep, grace_s, clock())
    return out
