"""safetensors headers read as plain JSON, and one tensor's bytes streamed from disk: no torch, no mapping.

A full-size base is judged by its headers alone: names, shapes, dtypes, byte ranges. The few tensors whose bytes
matter, the fingerprint's, are streamed in fixed chunks so memory stays flat, or only a sample of pages is read
(:func:`tensor_sample_sha256`; docs/fingerprint.md). ``verify-adapter`` and ``coverage`` read bases through this
module only."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from impl.errors import CheckpointMappingError, CorruptCheckpointError

__all__ = [
    "SAMPLE_PAGE",
    "SAMPLE_PAGES",
    "SAMPLED_ABOVE",
    "Header",
    "read_file_header",
    "read_headers",
    "sample_sha256",
    "shard_files",
    "tensor_sample_sha256",
    "tensor_sha256",
]

_CHUNK = 8 << 20
#: a tensor's sample: this many pages of this many bytes, evenly spread from its first byte to its last. A
#: different model, a fine-tune, a merge or a requantization changes every page; one flipped byte lands in one.
SAMPLE_PAGES = 64
SAMPLE_PAGE = 4096
#: tensors of more bytes than this have a sample distinct from their whole
SAMPLED_ABOVE = SAMPLE_PAGES * SAMPLE_PAGE
_SAMPLE_TAG = b"dsv4-lora sample v1"


@dataclass(frozen=True)
class Header:
    file: str
    shape: tuple[int, ...]
    dtype: str
    span: tuple[int, int] = (0, 0)  # the tensor's bytes: absolute [start, end) offsets in ``file``
    stored: str | None = None  # the name in ``file`` where it is not the official one (impl.conversion.layouts)


def shard_files(ckpt_dir: Path) -> list[Path]:
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointMappingError(f"no *.safetensors files in {ckpt_dir}; point at an official V4 checkpoint dir")
    return files


#: headers already parsed in this process, by file identity: one command reads a base's headers in several checks
_PARSED: dict[tuple, list[tuple[str, Header]]] = {}


def read_file_header(file: Path) -> list[tuple[str, Header]]:
    """Every (name, header) of one safetensors file in header order (a name written twice appears twice)."""
    try:
        st = os.stat(file)
        key = (
            os.path.realpath(file),
            st.st_dev,
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            Path(file).name,
        )
    except OSError:
        key = None
    if key in _PARSED:
        return list(_PARSED[key])
    found = _parse_file_header(Path(file))
    if key is not None:
        if len(_PARSED) >= 512:
            _PARSED.clear()
        _PARSED[key] = found
    return list(found)


def _parse_file_header(file: Path) -> list[tuple[str, Header]]:
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"header length {n} does not fit in the file's {size} bytes")
            text = fh.read(n)
        parsed = json.loads(text)
        entries = [(name, meta) for name, meta in parsed.items() if name != "__metadata__"]
        if text.count(b'"data_offsets"') > len(entries):  # a name written twice: keep every copy (slower parse)
            pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
            entries = [(name, dict(meta)) for name, meta in pairs if name != "__metadata__"]
        fname, start = file.name, 8 + n
        found = [
            (name, Header(fname, tuple(meta["shape"]), meta["dtype"], (start + int(b), start + int(e))))
            for name, meta in entries
            for b, e in (meta["data_offsets"],)
        ]
    except (ValueError, KeyError, TypeError, AttributeError, MemoryError) as exc:
        raise CorruptCheckpointError(
            f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc}); re-download or re-write it"
        ) from exc
    declared = max([h.span[1] for _, h in found], default=8 + n)
    if declared != size:
        raise CorruptCheckpointError(
            f"{file}: {size} bytes, but its header declares {declared} (truncated or padded); "
            "re-download or re-write it"
        )
    return found


def read_headers(ckpt_dir: Path) -> tuple[dict[str, Header], dict[str, list[str]]]:
    """name -> header over every shard of ``ckpt_dir``, and the names found in more than one place (-> files)."""
    headers: dict[str, Header] = {}
    seen: dict[str, list[str]] = {}
    for f in shard_files(ckpt_dir):
        for name, header in read_file_header(f):
            seen.setdefault(name, []).append(f.name)
            headers[name] = header
    dups = {n: fs for n, fs in seen.items() if len(fs) > 1}
    return _official(headers), dups


def _official(headers: dict[str, Header]) -> dict[str, Header]:
    """Headers under official names: a base transformers saved is translated (names of no V4 tensor stay as they
    are, for the strict load to name)."""
    from dataclasses import replace

    from impl.conversion.layouts import BaseLayout, read_as_official

    layout, official, unknown = read_as_official(headers)
    if layout is BaseLayout.OFFICIAL:
        return headers
    out = {name: replace(headers[stored], stored=stored) for name, stored in official.items()}
    out.update({name: headers[name] for name in unknown})
    return out


def tensor_sha256(ckpt_dir: Path, header: Header) -> str:
    """sha256 of one tensor's stored bytes, streamed (the same bytes a loaded tensor's storage holds)."""
    h = hashlib.sha256()
    start, end = header.span
    buf = bytearray(min(_CHUNK, end - start))
    view = memoryview(buf)
    with open(Path(ckpt_dir) / header.file, "rb", buffering=0) as fh:
        fh.seek(start)
        left = end - start
        while left > 0:
            got = fh.readinto(view[: min(len(buf), left)])
            if not got:
                raise CorruptCheckpointError(
                    f"{Path(ckpt_dir) / header.file}: ends inside tensor bytes [{start}, {end}); re-download it"
                )
            h.update(view[:got])
            left -= got
    return h.hexdigest()


def _sample_spans(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each sampled page of a tensor of ``nbytes`` (the whole tensor when it is that small)."""
    if nbytes <= SAMPLED_ABOVE:
        return [(0, nbytes)]
    last = nbytes - SAMPLE_PAGE
    return [(i * last // (SAMPLE_PAGES - 1), SAMPLE_PAGE) for i in range(SAMPLE_PAGES)]


def sample_sha256(raw: bytes | memoryview) -> str:
    """sha256 of a tensor's sampled pages (and its length): what :func:`tensor_sample_sha256` reads from a file."""
    view = memoryview(raw).cast("B")
    h = hashlib.sha256(_SAMPLE_TAG + len(view).to_bytes(8, "little"))
    for off, n in _sample_spans(len(view)):
        h.update(view[off : off + n])
    return h.hexdigest()


def tensor_sample_sha256(ckpt_dir: Path, header: Header) -> str:
    """:func:`sample_sha256` of one stored tensor, reading only its sampled pages."""
    start, end = header.span
    h = hashlib.sha256(_SAMPLE_TAG + (end - start).to_bytes(8, "little"))
    with open(Path(ckpt_dir) / header.file, "rb", buffering=0) as fh:
        for off, n in _sample_spans(end - start):
            page = os.pread(fh.fileno(), n, start + off)
            if len(page) != n:
                raise CorruptCheckpointError(
                    f"{Path(ckpt_dir) / header.file}: ends inside tensor bytes [{start}, {end}); re-download it"
                )
            h.update(page)
    return h.hexdigest()
