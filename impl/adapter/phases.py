"""The phases of the collective adapter export, in order: :data:`EXPORT_PHASES`.

Each phase is a function of the :class:`ExportContext`; every rank runs every phase, and only the writer rank
does file work. :func:`impl.adapter.export.export_adapter` runs the table and, after each phase, has all ranks
agree on the outcome before the next one starts. The table is public so a caller (e.g. a fault matrix) can pass
a copy with one phase wrapped; the names and their order are the protocol and cannot change."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from impl.adapter.build import (
    AdapterState,
    BuildOptions,
    BuiltAdapter,
    EmptyAdapterError,
    build_adapter,
    with_base_fingerprint,
)
from impl.adapter.files import (
    ADAPTER_FILE,
    CONFIG_FILE,
    config_text,
    fsync_path,
    recover_export_dir,
    set_aside,
    sidecars,
    write_marker,
)
from impl.adapter.staged import StagedFileCheck
from impl.adapter.validation import AdapterValidationError
from impl.adapter.writer import HashedWrite, write_safetensors


@dataclass
class ExportContext:
    """What the phases share on one rank during one export."""

    rank: int
    world: int
    writer: bool
    out_dir: Path
    adapter_phase: Callable[[], Any] | AdapterState | Mapping[str, AdapterState]
    options: BuildOptions
    state: Any = None
    built: BuiltAdapter | None = None
    payload: dict[str, torch.Tensor] | None = None
    payload_size: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    written: HashedWrite | None = None  # the staged adapter file: its header and its sha256, as written
    check: StagedFileCheck | None = None  # started by the fsync phase


def gather(ctx: ExportContext) -> None:
    """Every rank runs the caller's gather; the writer first rolls back an earlier crashed export."""
    if ctx.writer:
        recover_export_dir(ctx.out_dir)
    ctx.state = ctx.adapter_phase() if callable(ctx.adapter_phase) else ctx.adapter_phase
    if ctx.writer and ctx.state is None:
        raise EmptyAdapterError("the gather phase returned no adapter state on the writer rank")


def serialize(ctx: ExportContext) -> None:
    if ctx.writer:
        ctx.built = build_adapter(ctx.state, with_base_fingerprint(ctx.state, ctx.options), check_finite=False)
        ctx.payload = {k: v.to("cpu") for k, v in ctx.built.tensors.items()}


def write(ctx: ExportContext) -> None:
    if ctx.writer:
        staging, _, _ = sidecars(ctx.out_dir)
        ctx.out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        ctx.written = write_safetensors(staging / ADAPTER_FILE, ctx.payload, ctx.built.metadata)
        with open(staging / CONFIG_FILE, "w") as f:
            f.write(config_text(ctx.built.config))


def fsync(ctx: ExportContext) -> None:
    """The staged files and their directory are durable. The parent's entry for staging need not be: publish
    syncs the parent after moving the old destination aside, before staging takes its place."""
    if ctx.writer:
        staging, _, _ = sidecars(ctx.out_dir)
        # The re-read check needs only the page cache, so it runs while this phase waits for the disk.
        ctx.check = StagedFileCheck(staging / ADAPTER_FILE, ctx.payload, ctx.built, ctx.written)
        # Side by side: the small syncs join the adapter's journal commit instead of each waiting for one of its own.
        paths = (staging / ADAPTER_FILE, staging / CONFIG_FILE, staging)
        with ThreadPoolExecutor(max_workers=len(paths)) as pool:
            for synced in [pool.submit(fsync_path, path) for path in paths]:
                synced.result()


def validate(ctx: ExportContext) -> None:
    """Re-open the staged files: every tensor's bytes on disk identical to the validated (finite, shape-checked)
    in-memory tensor, the header as built (read back with safetensors), config as built. The file's sha256 may
    still be computing: only the marker needs it."""
    if not ctx.writer:
        return
    staging, _, _ = sidecars(ctx.out_dir)
    ctx.check.verify()
    ctx.payload_size = (staging / ADAPTER_FILE).stat().st_size
    raw = (staging / CONFIG_FILE).read_bytes()
    if json.loads(raw) != json.loads(config_text(ctx.built.config)):
        raise AdapterValidationError(f"{staging / CONFIG_FILE} differs from the exported config")
    ctx.hashes = {CONFIG_FILE: hashlib.sha256(raw).hexdigest()}  # the bytes just checked, not a re-read
    ctx.payload = None  # release the serialized copy before publishing


def publish(ctx: ExportContext) -> None:
    if not ctx.writer:
        return
    staging, _, _ = sidecars(ctx.out_dir)
    set_aside(ctx.out_dir)
    os.replace(staging, ctx.out_dir)
    fsync_path(ctx.out_dir.parent)
    # Cheap post-rename check: the published file is the validated one (its size and its header bytes).
    published = ctx.out_dir / ADAPTER_FILE
    with open(published, "rb") as f:
        size, head = os.fstat(f.fileno()).st_size, f.read(len(ctx.written.head))
    if size != ctx.payload_size or head != ctx.written.head:
        raise AdapterValidationError(
            f"{published}: the published file is not the validated one ({size} bytes published, "
            f"{ctx.payload_size} validated{'' if head == ctx.written.head else '; its header differs'})"
        )


def marker(ctx: ExportContext) -> None:
    if ctx.writer:
        ctx.hashes[ADAPTER_FILE] = ctx.check.digest()
        write_marker(ctx.out_dir, ctx.built.metadata["dsv4_dialect"], ctx.hashes)


def commit(ctx: ExportContext) -> None:
    if not ctx.writer:
        return
    _, old, trash = sidecars(ctx.out_dir)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(old, trash)  # the commit point: without .dsv4-old nothing will be rolled back


def after_commit(ctx: ExportContext) -> None:
    """Writer, past the commit point: make the rename durable and drop the old export. Best effort: a failure
    here cannot un-commit (a crash before the directory sync at worst brings ``.dsv4-old`` back, which the next
    export's recovery rolls back to), so it is a warning, not an export failure."""
    if not ctx.writer:
        return
    _, _, trash = sidecars(ctx.out_dir)
    try:
        fsync_path(ctx.out_dir.parent)
        shutil.rmtree(trash)
    except OSError as exc:
        warnings.warn(
            f"adapter export to {ctx.out_dir} is committed, but cleaning up after the commit failed: "
            f"{type(exc).__name__}: {exc}; the next export to it retries",
            RuntimeWarning,
            stacklevel=3,
        )


def roll_back(ctx: ExportContext, recover: bool) -> None:
    """After a failed phase: the writer (or, for a lost writer, the rank told to) restores the destination."""
    if recover:
        try:
            recover_export_dir(ctx.out_dir)
        except OSError:  # best effort; the next export's recovery retries
            pass
    if ctx.check is not None:
        ctx.check.join()
    ctx.payload = None


class ExportPhase(NamedTuple):
    name: str
    run: Callable[[ExportContext], None]


#: The protocol, in order. ``publish`` is the first phase that touches the destination, ``commit`` its commit point.
EXPORT_PHASES: tuple[ExportPhase, ...] = (
    ExportPhase("gather", gather),
    ExportPhase("serialize", serialize),
    ExportPhase("write", write),
    ExportPhase("fsync", fsync),
    ExportPhase("validate", validate),
    ExportPhase("publish", publish),
    ExportPhase("marker", marker),
    ExportPhase("commit", commit),
)

__all__ = [
    "EXPORT_PHASES",
]
