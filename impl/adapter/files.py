"""The files of an exported adapter directory, its ``.complete`` marker, and crash recovery.

The marker lives inside the directory it certifies and moves with it, so a stale marker never sits next to a
different adapter. The on-disk protocol is :func:`publish_files`'s; :func:`recover_export_dir` rolls back an
uncommitted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
COMPLETE_MARKER = ".complete"
MARKER_FORMAT = "dsv4-lora-adapter"
_ABSENT = ".dsv4-absent"
_CHUNK = 8 << 20


def sidecars(out_dir: Path) -> tuple[Path, Path, Path]:
    """(staging, old, trash) next to ``out_dir``."""
    parent, name = out_dir.parent, out_dir.name
    return parent / f".{name}.dsv4-staging", parent / f".{name}.dsv4-old", parent / f".{name}.dsv4-trash"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (what ``.complete`` certifies)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def config_text(config: Mapping[str, Any]) -> str:
    """``adapter_config.json`` as written."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def write_marker(out_dir: Path, dialect: str | None, hashes: Mapping[str, str], *, kind: str = MARKER_FORMAT) -> None:
    """Durably write ``out_dir/.complete`` certifying ``hashes`` (tmp + fsync + rename + directory fsync); ``kind``
    is what the directory is (an adapter, or :mod:`impl.adapter.training_checkpoint`'s training checkpoint)."""
    marker = {"format": kind, "version": 1, "files": dict(hashes)}
    if dialect is not None:
        marker["dialect"] = dialect
    tmp = out_dir / (COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / COMPLETE_MARKER)
    fsync_path(out_dir)


def set_aside(out_dir: Path) -> None:
    """Publish, step 1: move the current destination to ``.D.dsv4-old`` (or record that there was none)."""
    _, old, _ = sidecars(out_dir)
    if out_dir.exists():
        os.replace(out_dir, old)
    else:
        # ".dsv4-old" must hold its ".dsv4-absent" from the moment it exists: an empty one would be restored as
        # the destination (a crash between mkdir and the marker's creation, or a marker not yet durable).
        pending = _absent_pending(out_dir)
        shutil.rmtree(pending, ignore_errors=True)
        pending.mkdir()
        (pending / _ABSENT).touch()
        fsync_path(pending)
        os.replace(pending, old)
    fsync_path(out_dir.parent)


def _absent_pending(out_dir: Path) -> Path:
    """Where ``set_aside`` builds the "there was none" record before renaming it to ``.D.dsv4-old``."""
    _, old, _ = sidecars(out_dir)
    return old.with_name(old.name + ".tmp")


def recover_export_dir(out_dir: str | os.PathLike) -> str:
    """Roll back an export to ``out_dir`` that crashed before committing; returns what was done.

    Uncommitted = ``.<name>.dsv4-old`` exists: the published directory is removed and the old one restored.
    Staging and trash leftovers are deleted."""
    out_dir = Path(out_dir)
    staging, old, trash = sidecars(out_dir)
    actions = []
    if old.exists():
        if out_dir.exists():
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(out_dir, trash)
        if (old / _ABSENT).exists():
            shutil.rmtree(old)
        else:
            os.replace(old, out_dir)
        actions.append("restored the previous destination")
    for leftover in (staging, trash, _absent_pending(out_dir)):
        if leftover.exists():
            shutil.rmtree(leftover)
            actions.append(f"removed {leftover.name}")
    if actions and out_dir.parent.exists():
        fsync_path(out_dir.parent)
    return "; ".join(actions) or "nothing to recover"


def publish_files(
    out_dir: str | os.PathLike, files: Mapping[str, bytes], dialect: str | None, *, kind: str = MARKER_FORMAT
) -> Path:
    """Publish ``files`` (name -> bytes) as the directory ``out_dir`` by the protocol below, for a writer that is
    not the collective export (``dsv4-lora convert-adapter``, a training checkpoint's writer): crash leftovers
    rolled back, staging written and fsynced, old destination set aside, staging renamed in, marker, commit. On any failure before the commit the
    destination is restored exactly.

    The protocol (writer rank, destination ``D`` in parent ``P``; one export per destination at a time):
    ``P/.D.dsv4-staging`` is written, fsynced and re-validated; publish renames ``D`` aside to ``P/.D.dsv4-old``
    (or creates that directory holding ``.dsv4-absent`` when ``D`` did not exist), then renames staging to ``D``;
    the marker ``D/.complete`` (tmp + fsync + rename) names the sha256 of every file; commit renames the old
    directory to ``P/.D.dsv4-trash`` (the atomic commit point), and the trash is deleted afterwards. While
    ``.D.dsv4-old`` exists the export is uncommitted and :func:`recover_export_dir` rolls back to it."""
    out = Path(os.path.abspath(out_dir))
    recover_export_dir(out)
    staging, old, trash = sidecars(out)
    try:
        staging.mkdir(parents=True)
        for name, data in files.items():
            with open(staging / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(staging)
        set_aside(out)
        os.replace(staging, out)
        fsync_path(out.parent)
        write_marker(out, dialect, {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}, kind=kind)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(old, trash)  # the commit point
    except BaseException:
        recover_export_dir(out)
        raise
    shutil.rmtree(trash, ignore_errors=True)
    fsync_path(out.parent)
    return out


__all__ = [
    "COMPLETE_MARKER",
    "recover_export_dir",
]
