"""An adapter file's tensors read without torch: what ``verify-adapter`` checks needs bytes, shapes and dtypes only.

Importing torch is costly before a command reads anything, and an adapter's checks are plain reads.
:func:`read_safetensors` parses the file through :mod:`impl.conversion.headers`, the one header reader, which names
truncation and corruption, and keeps each tensor's bytes; :meth:`RawTensor.torch` materializes one where arithmetic
is needed (``verify-adapter --forward``, re-publishing with ``export --adapter``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impl.conversion.headers import read_file_header

#: safetensors dtype -> the torch dtype name (what a loaded tensor's dtype prints as)
DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
#: NaN/Inf <=> every exponent bit set <=> the bits without the sign, read unsigned, >= the exponent mask.
#: Per safetensors dtype: (signed and unsigned integer of its width, as numpy dtype names, and the exponent mask).
EXPONENT_BITS: dict[str, tuple[str, str, int]] = {
    "BF16": ("<i2", "<u2", 0x7F80),
    "F16": ("<i2", "<u2", 0x7C00),
    "F32": ("<i4", "<u4", 0x7F800000),
    "F64": ("<i8", "<u8", 0x7FF0000000000000),
}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"})


def finite_bits(raw: Any, code: str) -> bool:
    """No NaN/Inf among the bytes ``raw`` (a numpy array or buffer) of safetensors dtype ``code`` (whole elements).

    Two reductions that only read: read signed, a positive NaN/Inf is the largest value (>= the mask); read
    unsigned, a negative one is (>= sign bit | mask). No temporary the size of the tensor, unlike masking first."""
    import numpy as np

    signed, unsigned, mask = EXPONENT_BITS[code]
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if data.size == 0:
        return True
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    return int(data.view(signed).max()) < mask and int(data.view(unsigned).max()) < (sign | mask)


@dataclass(frozen=True)
class RawTensor:
    """One stored tensor: its safetensors dtype code, shape and bytes."""

    code: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @property
    def dtype(self) -> str:
        """The torch name of the dtype (``bfloat16``), as a message prints it."""
        return DTYPE_NAMES.get(self.code, self.code)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.code in FLOAT_DTYPES

    def torch(self) -> Any:
        """The tensor, for arithmetic (imports torch)."""
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


def all_finite(t: RawTensor) -> bool:
    """No NaN/Inf in a floating tensor (a dtype without a mask here, FP8, is never a LoRA weight)."""
    return t.code not in EXPONENT_BITS or finite_bits(t.data, t.code)


def read_safetensors(file: Path) -> tuple[dict[str, str], dict[str, RawTensor]]:
    """(the header's ``__metadata__``, name -> tensor) of one safetensors file."""
    headers = read_file_header(file)
    data = Path(file).read_bytes()
    view = memoryview(data)  # slices share the file's bytes
    tensors = {name: RawTensor(h.dtype, tuple(h.shape), view[h.span[0] : h.span[1]]) for name, h in headers}
    return _metadata(data[8 : 8 + int.from_bytes(data[:8], "little")]), tensors


def read_metadata(file: Path) -> dict[str, str]:
    """The header's ``__metadata__`` of one safetensors file (the header alone is read)."""
    read_file_header(file)  # a corrupt file is named there
    with open(file, "rb") as fh:
        return _metadata(fh.read(int.from_bytes(fh.read(8), "little")))


def _metadata(header: bytes) -> dict[str, str]:
    return json.loads(header).get("__metadata__") or {}


__all__ = [
    "DTYPE_NAMES",
    "EXPONENT_BITS",
    "RawTensor",
    "all_finite",
    "finite_bits",
    "read_metadata",
    "read_safetensors",
]
