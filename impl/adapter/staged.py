"""The staged file check: before anything is published, the written adapter file is read back and must hold
exactly the bytes written (the validated tensors, all finite), so the sha256 taken as they were written is what
``.complete`` will certify."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from impl.adapter.build import EXPONENT_MASKS, BuiltAdapter, NonFiniteAdapterError, all_finite, finite_bits
from impl.adapter.files import ADAPTER_FILE
from impl.adapter.validation import AdapterValidationError
from impl.adapter.writer import ST_DTYPES, HashedWrite


class StagedFileCheck:
    """Background re-read of a written safetensors file through one read-only mmap, started as soon as it is
    written, so it runs while the fsync phase waits for the disk: one thread compares the file's header bytes with
    those written and every tensor's bytes with the in-memory tensor it must hold, then checks that tensor for
    NaN/Inf while it is in the CPU cache (numpy releases the GIL), and last reads the header back with the
    safetensors library (:func:`check_header`). :meth:`verify` waits for it and raises
    :class:`AdapterValidationError` / :class:`NonFiniteAdapterError` (naming the native tensor, from the built
    adapter's ``sources``). The file then holds exactly the bytes the writer hashed as it wrote them:
    :meth:`digest` is their sha256."""

    def __init__(
        self,
        path: Path,
        payload: Mapping[str, torch.Tensor],
        built: BuiltAdapter,
        written: HashedWrite,
    ):
        self.path, self.payload, self.built, self.written = path, payload, built, written
        self.errors: list[str] = []
        self.nonfinite: list[str] = []
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.comparing = threading.Thread(target=self._compare_guarded, daemon=True)
        self.comparing.start()

    def _compare_guarded(self) -> None:
        try:
            self._compare()
            if not self.errors:
                check_header(self.path.parent, self.built)
        except AdapterValidationError as exc:
            self.errors.append(str(exc))
        except Exception as exc:  # reported by verify(), on the phase's own thread
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _compare(self) -> None:
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        if bytes(buf[: len(self.written.head)]) != self.written.head:
            self.errors.append(f"{self.path}: the header on disk differs from the one written")
            return
        # the header on disk is the one written, so each tensor lies where the writer put it
        for name, want in self.payload.items():
            start, end = self.written.spans[name]
            raw = self.written.raw[name]
            if not _same_bytes(buf[start:end], raw):
                self.errors.append(f"{self.path}: tensor {name} on disk differs from the export")
            elif not (finite_bits(raw, want.dtype) if want.dtype in EXPONENT_MASKS else all_finite(want)):
                self.nonfinite.append(name)
        del buf

    def verify(self) -> None:
        """The file holds exactly the exported tensors, all finite (else raise, naming them)."""
        self.comparing.join()
        self.payload = {}  # the in-memory copy is no longer needed, nor the writer's views of it
        self.written.release()
        if self.errors:
            raise AdapterValidationError("; ".join(self.errors))
        if self.nonfinite:
            named = ", ".join(f"{self.built.sources.get(name, name)} (exported as {name})" for name in self.nonfinite)
            raise NonFiniteAdapterError(f"{named} hold(s) NaN/Inf values; refusing to publish a corrupt adapter")

    def digest(self) -> str:
        """The file's sha256 (hex); only after :meth:`verify` passed is it the hash of the file's bytes."""
        self.join()
        return self.written.digest()

    def join(self) -> None:
        self.comparing.join()
        try:
            self.mm.close()
        except BufferError:  # a view survived in a traceback; the mapping goes with it
            pass


def _same_bytes(on_disk: np.ndarray, raw: np.ndarray) -> bool:
    """Whole 8-byte words compared as uint64 (several times faster than byte by byte), then the tail."""
    words = on_disk.size - on_disk.size % 8
    return bool(
        np.array_equal(on_disk[:words].view(np.uint64), raw[:words].view(np.uint64))
        and np.array_equal(on_disk[words:], raw[words:])
    )


def check_header(path: Path, built: BuiltAdapter) -> None:
    """The safetensors header in ``path`` names exactly the built tensors (shape, dtype) and metadata."""
    from safetensors import safe_open

    with safe_open(str(path / ADAPTER_FILE), framework="pt") as f:
        got = {k: (list(sl.get_shape()), sl.get_dtype()) for k in f.keys() for sl in (f.get_slice(k),)}
        meta = f.metadata() or {}
    want = {k: (list(v.shape), ST_DTYPES.get(v.dtype, str(v.dtype))) for k, v in built.tensors.items()}
    if got != want:
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:4]
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: tensor names/shapes/dtypes differ from the export: {bad}")
    if meta != built.metadata:
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: header metadata differs from the export")
