"""The adapter file, written by us in the safetensors format and hashed while it is written.

``.complete`` certifies the file's sha256, and ``safetensors.torch.save_file`` cannot be tailed, so writing the format
ourselves lets a second thread hash the very bytes in file order as they are written (:func:`write_safetensors`).
The same adapter always gives the same bytes. The validate phase still reads the file back with the safetensors
library (:mod:`impl.adapter.staged`); the byte layout is in :func:`safetensors_header`."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from impl.adapter.build import raw_bytes

#: safetensors' dtype names, largest first: the library's layout order
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.int64: "I64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_LAYOUT_RANK = {dtype: i for i, dtype in enumerate(ST_DTYPES)}
_WRITE_CHUNK = 8 << 20  # bytes per os.write: hashed by the other thread while the next is written


def safetensors_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's first bytes (size + padded JSON header) and, in file order, each tensor's byte span in the file.

    The safetensors format (its README, "Format"): an 8-byte little-endian header size N, N bytes of JSON
    (``__metadata__`` plus, per tensor, dtype, shape and ``data_offsets`` into the data that follows), padded with
    spaces to a multiple of 8, then the tensors' bytes back to back. Tensors are laid out as the library lays them
    out (larger dtypes first, then by name); metadata keys are sorted, so the same adapter gives the same bytes (the
    library's metadata order varies from run to run).
    """
    unknown = sorted(f"{name} ({t.dtype})" for name, t in tensors.items() if t.dtype not in ST_DTYPES)
    if unknown:
        raise ValueError(f"no safetensors dtype for {', '.join(unknown)}")
    order = sorted(tensors, key=lambda name: (_LAYOUT_RANK[tensors[name].dtype], name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        offsets[name] = (offset, offset + t.numel() * t.element_size())
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": list(offsets[name])}
        offset = offsets[name][1]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    return head, {name: (len(head) + a, len(head) + b) for name, (a, b) in offsets.items()}


class _Hasher(threading.Thread):
    """sha256 of the chunks put on its queue, in order (``None`` ends it); hashlib releases the GIL."""

    def __init__(self) -> None:
        super().__init__(name="dsv4-adapter-hash", daemon=True)
        self.chunks: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self.sha = hashlib.sha256()
        self.error = ""

    def run(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            if self.error:
                continue  # drain: the writer must never block on a dead consumer
            try:
                self.sha.update(chunk)
            except Exception as exc:  # reported by digest()
                self.error = f"{type(exc).__name__}: {exc}"


class HashedWrite:
    """A file :func:`write_safetensors` wrote: its first bytes (``head``: size and header), each tensor's byte span
    in it (``spans``) and the bytes written there (``raw``, views of the tensors), and its sha256 (which waits for
    the hashing thread)."""

    def __init__(
        self,
        hasher: _Hasher,
        head: bytes,
        spans: dict[str, tuple[int, int]],
        raw: dict[str, np.ndarray],
        path: Path,
    ):
        self._hasher, self.head, self.spans, self.raw, self.path = hasher, head, spans, raw, path

    def release(self) -> None:
        """Drop the views of the written tensors once nothing compares with them any more."""
        self.raw = {}

    def digest(self) -> str:
        self._hasher.join()
        if self._hasher.error:
            raise OSError(f"{self.path}: hashing the written bytes failed ({self._hasher.error})")
        return self._hasher.sha.hexdigest()


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> HashedWrite:
    """Write ``tensors`` (CPU, contiguous) to a new file ``path`` in the safetensors format; the file's sha256 is
    computed from the same bytes as they are written. Raises ``FileExistsError`` if ``path`` exists; on any error
    the partial file is removed.

    Why: hashing the file once written is the export's longest CPU step after the write itself, and
    ``safetensors.torch.save_file`` cannot be tailed (it writes a private temporary, maps it and renames it). Here a
    second thread hashes the bytes in file order while the first writes them, so the digest is ready about when the
    file is. The validate phase still reads the file back with the safetensors library (its header) and byte for
    byte (its tensors), checking the tensors for NaN/Inf in the same pass (:mod:`impl.adapter.staged`): that thread
    has the slack while the fsync waits for the disk, the hash has none.
    """
    head, spans = safetensors_header(tensors, metadata)
    raw = {name: raw_bytes(tensors[name]) for name in spans}  # file order
    hasher = _Hasher()
    hasher.start()
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides the mode, as for open()
    try:
        for chunk in _chunks(head, raw):
            hasher.chunks.put(chunk)
            _write_all(fd, chunk)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    finally:
        hasher.chunks.put(None)
    os.close(fd)
    return HashedWrite(hasher, head, spans, raw, path)


def _chunks(head: bytes, raw: Mapping[str, np.ndarray]) -> Iterator[memoryview]:
    """The file's bytes in order, the header first, in pieces of at most :data:`_WRITE_CHUNK`."""
    yield memoryview(head)
    for data in raw.values():
        view = memoryview(data)
        for i in range(0, len(view), _WRITE_CHUNK):
            yield view[i : i + _WRITE_CHUNK]


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]


__all__ = ["ST_DTYPES", "HashedWrite", "safetensors_header", "write_safetensors"]
