"""A GGUF file's metadata and tensor table, read without holding per-item views of its arrays.

The `gguf` package's `GGUFReader` keeps a numpy view for every item of every metadata array: a
vocabulary of 49k tokens and 49k merges becomes ~250k small arrays, 157 MiB resident for a 94 MiB
file, held as long as the reader lives. This reads the same layout (GGUF versions 2 and 3,
little-endian) straight into plain Python values: a few MiB. Tensors are numpy views of one
read-only memory map of the file, shaped and typed as `GGUFReader` shapes them (float types as
their numpy dtype, block types as bytes per row), so `gguf.quants.dequantize` takes them as they
are. `release(tensor)` drops a tensor's pages from this process once it has been repacked (they
come back from the page cache if it is read again), so loading never holds the whole file and all
the repacked weights resident at once.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml's GGML_MAX_DIMS: no tensor has more dimensions.
MAX_DIMS = 4
# Arrays of arrays: llama.cpp writes none; a file nesting them deeper is refused, not recursed into.
MAX_ARRAY_DEPTH = 4
# The longest metadata array read (the largest vocabularies hold about 262k tokens): a longer one
# would become gigabytes of Python objects.
MAX_ARRAY_ITEMS = 1 << 22
# The fewest bytes one item of each kind takes in the file (a string: its 8-byte length; an array: its
# 4-byte item type and 8-byte count; a tensor's info: name length, dims, type and offset).
_MIN_STRING_BYTES, _MIN_ARRAY_BYTES, _MIN_FIELD_BYTES, _MIN_TENSOR_INFO_BYTES = 8, 12, 12, 24

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
# Tensor types stored as plain numbers (one per element); the others are blocks of bytes.
_Q = GGMLQuantizationType
_ELEMENT_DTYPES = {
    _Q.F32: np.float32, _Q.F16: np.float16, _Q.F64: np.float64, _Q.I8: np.int8, _Q.I16: np.int16,
    _Q.I32: np.int32, _Q.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (fastest dimension first), `data` a view of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int  # from the start of the file
    data: np.ndarray


class GGUFFile:
    """`metadata` (key -> str, int, float, bool or a list of those; None for nested arrays) and
    `tensors`, in the file's order. Raises ValueError for a file that is not a readable GGUF."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < 24:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        cursor = _Cursor(self._map)
        if cursor.take(4) != MAGIC:
            raise ValueError("no GGUF magic number at the start")
        version = cursor.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}; supported: 2, 3")
        num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        cursor.expect(num_fields, _MIN_FIELD_BYTES, "metadata fields")
        cursor.expect(num_tensors, _MIN_TENSOR_INFO_BYTES, "tensors")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            if key in self.metadata:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = [_tensor_info(cursor) for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r}: must be a power of two")
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors = [self._tensor(info, data_start, size) for info in infos]
        names = [tensor.name for tensor in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")

    def _tensor(self, info: tuple[str, tuple[int, ...], int, int], data_start: int, size: int) -> GGUFTensor:
        name, shape, raw_type, offset = info
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        elements = math.prod(shape)  # Python's integers: a lying shape cannot wrap around
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        if shape and shape[0] % block:
            raise ValueError(
                f"tensor {name!r}: rows of {shape[0]} do not divide into {tensor_type.name} blocks"
            )
        nbytes = elements // block * block_bytes
        start = data_start + offset
        if not shape or 0 in shape:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}: no dimension may be 0")
        if start + nbytes > size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        numpy_shape = tuple(reversed(shape))
        dtype = _ELEMENT_DTYPES.get(tensor_type)
        view = self._bytes[start : start + nbytes]
        if dtype is not None:
            data = view.view(dtype).reshape(numpy_shape)
        else:
            data = view.reshape(*numpy_shape[:-1], numpy_shape[-1] // block * block_bytes)
        return GGUFTensor(name, tensor_type, shape, start, data)

    def release(self, tensor: GGUFTensor) -> None:
        """Let this process's resident copy of `tensor`'s bytes go (whole pages inside it only)."""
        if not hasattr(self._map, "madvise"):  # Windows: the pages stay until the map closes
            return
        page = mmap.PAGESIZE
        start = -(-tensor.data_offset // page) * page
        end = (tensor.data_offset + tensor.data.nbytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    """Reads GGUF's little-endian values one after another."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def take(self, count: int) -> bytes:
        end = self.offset + count
        if end > len(self.buffer):
            raise ValueError(f"the header runs past the end of the file (at byte {self.offset})")
        data = self.buffer[self.offset : end]
        self.offset = end
        return data

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError(f"the header runs past the end of the file (at byte {self.offset})")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def expect(self, count: int, min_bytes: int, what: str) -> None:
        """Refuse at once a count of items that cannot fit in the rest of the file."""
        left = len(self.buffer) - self.offset
        if count * min_bytes > left:
            raise ValueError(
                f"{count:,} {what} would run past the end of the file ({left:,} bytes left after "
                f"byte {self.offset})"
            )

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind} (at byte {self.offset})")
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(
                f"a metadata value nests arrays more than {MAX_ARRAY_DEPTH} deep (at byte {self.offset})"
            )
        item, count = self.scalar("<I"), self.scalar("<Q")
        if count > MAX_ARRAY_ITEMS:
            raise ValueError(
                f"a metadata array of {count:,} items (at byte {self.offset}); the longest read is "
                f"{MAX_ARRAY_ITEMS:,}"
            )
        if item in _SCALARS:  # numbers in one read, not one per item
            fmt = _SCALARS[item]
            values = self.take(count * struct.calcsize(fmt))
            return list(struct.unpack(f"<{count}{fmt[1]}", values))
        if item == GGUFValueType.STRING:
            self.expect(count, _MIN_STRING_BYTES, "strings")
        elif item == GGUFValueType.ARRAY:
            self.expect(count, _MIN_ARRAY_BYTES, "arrays")
        else:
            raise ValueError(f"unknown metadata array item type {item} (at byte {self.offset})")
        items = [self.value(item, depth + 1) for _ in range(count)]
        return None if item == GGUFValueType.ARRAY else items  # nested arrays: nothing reads them


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = cursor.scalar("<I")
    if not 1 <= dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {dims} dimensions; a GGUF tensor has 1 to {MAX_DIMS}")
    shape = tuple(cursor.scalar("<Q") for _ in range(dims))
    return name, shape, cursor.scalar("<I"), cursor.scalar("<Q")
