"""The staged file check: before anything is published, the written adapter file is read back and must hold
exactly the bytes written (the validated tensors, all finite), so the sha256 taken as they were written is what
``.complete`` will certify."""

from __future__ import annotations

import json
import mmap
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from impl.adapter.build import EXPONENT_MASKS, BuiltAdapter, NonFiniteAdapterError, all_finite, finite_bits, raw_bytes
from impl.adapter.files import ADAPTER_FILE
from impl.adapter.validation import AdapterValidationError
from impl.adapter.writer import ST_DTYPES, HashedWrite

_CHUNK = 1 << 20  # compared and checked for NaN/Inf while in the CPU cache


class StagedFileCheck:
    """Background re-read of a written safetensors file through one read-only mmap, started as soon as it is
    written, so it runs while the fsync phase waits for the disk: one thread compares the file's header bytes with
    those written and every tensor's bytes with the in-memory tensor it must hold, checking those bytes for NaN/Inf
    in the same pass, chunk by chunk (it releases the GIL). :meth:`verify` waits for it and raises
    :class:`AdapterValidationError` / :class:`NonFiniteAdapterError` (naming the native tensor, from ``sources``).
    The file then holds exactly the bytes the writer hashed as it wrote them: :meth:`digest` is their sha256."""

    def __init__(
        self,
        path: Path,
        payload: Mapping[str, torch.Tensor],
        sources: Mapping[str, str],
        written: HashedWrite,
    ):
        self.path, self.payload, self.sources, self.written = path, payload, sources, written
        self.errors: list[str] = []
        self.nonfinite: list[str] = []
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.comparing = threading.Thread(target=self._compare_guarded, daemon=True)
        self.comparing.start()

    def _compare_guarded(self) -> None:
        try:
            self._compare()
        except Exception as exc:  # reported by verify(), on the phase's own thread
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _compare(self) -> None:
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        if bytes(buf[: len(self.written.head)]) != self.written.head:
            self.errors.append(f"{self.path}: the header on disk differs from the one written")
            return
        (n,) = np.frombuffer(self.mm, dtype="<u8", count=1)
        header = json.loads(bytes(buf[8 : 8 + int(n)]))
        base = 8 + int(n)
        scratch = np.empty(_CHUNK, dtype=np.uint8)
        for name, want in self.payload.items():
            start, end = header.get(name, {}).get("data_offsets", (0, -1))
            raw = raw_bytes(want)
            if end - start != raw.size:
                self.errors.append(f"{self.path}: tensor {name} has {end - start} bytes on disk, {raw.size} exported")
                continue
            on_disk = buf[base + start : base + end]
            same, finite = _compare_chunks(on_disk, raw, want.dtype, scratch)
            finite = finite if want.dtype in EXPONENT_MASKS else all_finite(want)
            if not same:
                self.errors.append(f"{self.path}: tensor {name} on disk differs from the export")
            elif not finite:
                self.nonfinite.append(f"{self.sources.get(name, name)} (exported as {name})")
        del buf

    def verify(self) -> None:
        """The file holds exactly the exported tensors, all finite (else raise, naming them)."""
        self.comparing.join()
        self.payload = {}  # the in-memory copy is no longer needed
        if self.errors:
            raise AdapterValidationError("; ".join(self.errors))
        if self.nonfinite:
            raise NonFiniteAdapterError(
                f"{', '.join(self.nonfinite)} hold(s) NaN/Inf values; refusing to publish a corrupt adapter"
            )

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


def _compare_chunks(on_disk: np.ndarray, raw: np.ndarray, dtype: torch.dtype, scratch: np.ndarray) -> tuple[bool, bool]:
    """(bytes equal, no NaN/Inf) for one tensor: each chunk is compared, then checked for NaN/Inf by its bits while
    cached (``dtype`` in :data:`EXPONENT_MASKS`; otherwise finiteness is left to the caller). Whole 8-byte words are
    compared as uint64, several times faster than byte by byte."""
    by_bits = dtype in EXPONENT_MASKS
    finite = True
    for i in range(0, raw.size, _CHUNK):
        disk, mem = on_disk[i : i + _CHUNK], raw[i : i + _CHUNK]
        words = disk.size - disk.size % 8
        if not (
            np.array_equal(disk[:words].view(np.uint64), mem[:words].view(np.uint64))
            and np.array_equal(disk[words:], mem[words:])
        ):
            return False, finite
        if by_bits and finite:
            finite = finite_bits(disk, dtype, scratch)
    return True, finite


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
