"""The staged file check: before anything is published, the written adapter file is read back and must hold
exactly the validated tensors, all finite; its sha256 is what ``.complete`` will certify."""

from __future__ import annotations

import hashlib
import json
import mmap
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from impl.adapter.build import EXPONENT_MASKS, BuiltAdapter, NonFiniteAdapterError, all_finite, finite_bits, raw_bytes
from impl.adapter.files import ADAPTER_FILE
from impl.adapter.validation import AdapterValidationError

_CHUNK = 8 << 20


class StagedFileCheck:
    """Background re-read of a written safetensors file through one read-only mmap: thread 1 compares every
    tensor's bytes with the in-memory tensor it must hold and checks the (equal) values for NaN/Inf, chunk by
    chunk while they are in cache; thread 2 computes the file's sha256 (both release the GIL). :meth:`result`
    joins them and returns the digest or raises :class:`AdapterValidationError` / :class:`NonFiniteAdapterError`
    (naming the native tensor, from ``sources``)."""

    def __init__(self, path: Path, payload: Mapping[str, torch.Tensor], sources: Mapping[str, str]):
        self.path, self.payload, self.sources = path, payload, sources
        self.errors: list[str] = []
        self.nonfinite: list[str] = []
        self.digest = ""
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.threads = [
            threading.Thread(target=self._guarded, args=(fn,), daemon=True) for fn in (self._compare, self._hash)
        ]
        for t in self.threads:
            t.start()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # reported by result(), on the phase's own thread
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _hash(self) -> None:
        self.digest = hashlib.sha256(self.mm).hexdigest()

    def _compare(self) -> None:
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        (n,) = np.frombuffer(self.mm, dtype="<u8", count=1)
        header = json.loads(bytes(buf[8 : 8 + int(n)]))
        base = 8 + int(n)
        for name, want in self.payload.items():
            start, end = header.get(name, {}).get("data_offsets", (0, -1))
            raw = raw_bytes(want)
            if end - start != raw.size:
                self.errors.append(f"{self.path}: tensor {name} has {end - start} bytes on disk, {raw.size} exported")
                continue
            by_bits = want.dtype in EXPONENT_MASKS
            finite = by_bits or all_finite(want)
            for i in range(0, raw.size, _CHUNK):  # chunked: no full-size temporary
                chunk = raw[i : i + _CHUNK]
                if not np.array_equal(buf[base + start + i : base + start + i + chunk.size], chunk):
                    self.errors.append(f"{self.path}: tensor {name} on disk differs from the export")
                    break
                if by_bits and finite:  # the bytes on disk are these: check them while cached
                    finite = finite_bits(chunk, want.dtype)
            if not finite:
                self.nonfinite.append(f"{self.sources.get(name, name)} (exported as {name})")
        del buf

    def result(self) -> str:
        self.join()
        if self.errors:
            raise AdapterValidationError("; ".join(self.errors))
        if self.nonfinite:
            raise NonFiniteAdapterError(
                f"{', '.join(self.nonfinite)} hold(s) NaN/Inf values; refusing to publish a corrupt adapter"
            )
        return self.digest

    def join(self) -> None:
        for t in self.threads:
            t.join()
        try:
            self.mm.close()
        except BufferError:  # a view survived in a traceback; the mapping goes with it
            pass


def check_header(path: Path, built: BuiltAdapter) -> None:
    """The safetensors header in ``path`` names exactly the built tensors (shape, dtype) and metadata."""
    from safetensors import safe_open

    with safe_open(str(path / ADAPTER_FILE), framework="pt") as f:
        got = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        meta = f.metadata() or {}
    want = {k: (list(v.shape), _ST_DTYPES.get(v.dtype, str(v.dtype))) for k, v in built.tensors.items()}
    if got != want:
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:4]
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: tensor names/shapes/dtypes differ from the export: {bad}")
    if meta != built.metadata:
        raise AdapterValidationError(f"{path / ADAPTER_FILE}: header metadata differs from the export")


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}
