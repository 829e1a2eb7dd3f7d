"""A small GGUF reader: the metadata and the tensor table, with tensor data as NumPy views of
a memory map (what `gguf.quants.dequantize` takes).

`gguf.GGUFReader` builds a NumPy view for every element of every metadata array (a
vocabulary of 49,152 strings and as many merges: seconds at start-up); this one skips the
arrays it is not asked for and reads scalars and short arrays with `struct`.

Layout (little-endian): "GGUF", version u32, tensor count u64, metadata count u64; metadata
entries (key string, value type u32, value); tensor infos (name string, n_dims u32, dims u64
each, ggml type u32, offset u64); then the tensor data, starting at the next multiple of
`general.alignment` (32 by default), each tensor at its offset from there. A string is a u64
length and UTF-8 bytes.

Nothing in the file is trusted: every read is checked against the file size, and every count
is checked against the bytes left before anything is read or allocated for it, so a truncated
or corrupt file raises GGUFError (one line naming the file and the problem) and reading one
never allocates more than the file holds.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from cbgen.models.errors import ModelFileError

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# value types: the scalars' struct formats; 8 = string, 9 = array
_SCALARS = {
    t: struct.Struct(f)
    for t, f in {
        0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
    }.items()
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_READ = 4096
"""Arrays longer than this are skipped (tokenizer vocabularies, merges, scores)."""
_MAX_NESTING = 4
"""Arrays of arrays deeper than this are refused (a file could otherwise recurse without end)."""
_MAX_DIMS = 4
"""GGML_MAX_DIMS: ggml tensors have at most four dimensions."""

# The fewest bytes each item can take, to check a count against the bytes left before looping.
_MIN_ENTRY = 8 + 4 + 1  # metadata: an empty key, the value type, a one-byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name, n_dims 0, ggml type, offset
_MIN_STRING = 8
_MIN_ARRAY = 4 + 8

_PLAIN: dict[int, np.dtype[Any]] = {
    0: np.dtype(np.float32),
    1: np.dtype(np.float16),
    24: np.dtype(np.int8),
    25: np.dtype(np.int16),
    26: np.dtype(np.int32),
    27: np.dtype(np.int64),
    28: np.dtype(np.float64),
}
"""ggml type ids stored unquantized (F32, F16, I8, I16, I32, I64, F64), as NumPy dtypes."""


class GGUFError(ModelFileError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int
    """ggml type id (gguf.GGMLQuantizationType)."""
    shape: tuple[int, ...]
    """ggml order: shape[0] is the innermost (contiguous) dimension."""
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._map = _map_file(path)
        self._size = len(self._map)
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        self._where = "the header"
        """What is being read, for error messages."""
        magic = bytes(self._buf[:4])
        if magic != b"GGUF"[: len(magic)]:
            raise GGUFError(
                f"model file {path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')"
            )
        self._take(4)
        version = self._scalar(_U32)
        if version not in (2, 3):
            raise self._error(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = self._scalar(_U64)
        n_kv = self._count(self._scalar(_U64), _MIN_ENTRY, "metadata entries")
        self._count(n_tensors, _MIN_TENSOR_INFO, "tensors")
        self.fields: dict[str, Any] = {}
        """Every metadata value; arrays longer than 4096 items are None."""
        for i in range(n_kv):
            self._where = f"metadata entry {i}"
            key = self._string()
            self._where = f"metadata {key!r}"
            if key in self.fields:
                raise self._error(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._scalar(_U32))
        infos = []
        for i in range(n_tensors):
            self._where = f"tensor info {i}"
            name = self._string()
            self._where = f"the info of tensor {name!r}"
            n_dims = self._scalar(_U32)
            if n_dims > _MAX_DIMS:
                raise self._error(
                    f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}"
                )
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._take(8 * n_dims))
            ggml_type = self._scalar(_U32)
            offset = self._scalar(_U64)
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        if len({info[0] for info in infos}) < len(infos):
            raise self._error("a tensor name appears twice in the tensor table")
        align = self._alignment()
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---- reading ----------------------------------------------------------------------
    def _error(self, problem: str) -> GGUFError:
        return GGUFError(f"model file {self.path}: {problem}")

    def _take(self, n: int) -> int:
        """Claim the next n bytes for what is being read; returns where they start."""
        start = self._pos
        end = start + n
        if end > self._size:
            raise GGUFError(
                f"model file {self.path} is truncated or corrupt: {self._where} ends at byte "
                f"{end}, past the end of the file ({self._size} bytes)"
            )
        self._pos = end
        return start

    def _count(self, n: int, min_bytes: int, what: str) -> int:
        """A count read from the file, checked before anything is looped over or allocated for
        it: n items of at least min_bytes each must fit in the bytes left."""
        left = self._size - self._pos
        if n * min_bytes > left:
            raise GGUFError(
                f"model file {self.path} is truncated or corrupt: {self._where} counts {n} "
                f"{what}, more than the {left} bytes left in the file can hold"
            )
        return n

    def _scalar(self, s: struct.Struct) -> Any:
        return s.unpack_from(self._buf, self._take(s.size))[0]

    def _string(self) -> str:
        n = self._scalar(_U64)
        start = self._take(n)
        return bytes(self._buf[start : start + n]).decode("utf-8", errors="replace")

    def _skip_strings(self, n: int) -> None:
        """Skip n strings (a vocabulary: tens of thousands, so the loop is kept tight)."""
        pos, size, buf, unpack = self._pos, self._size, self._buf, _U64.unpack_from
        for _ in range(n):
            end = pos + 8
            if end <= size:
                end += unpack(buf, pos)[0]
            if end > size:
                self._take(end - self._pos)  # raises: past the end of the file
            pos = end
        self._pos = pos

    def _value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise self._error(f"{self._where} has the unknown value type {vtype}")
        itype = self._scalar(_U32)
        n = self._scalar(_U64)
        if itype in _SCALARS:
            s = _SCALARS[itype]
            start = self._take(s.size * self._count(n, s.size, "array items"))
            if n > _MAX_ARRAY_READ:
                return None
            return list(struct.unpack_from(f"<{n}{s.format[1:]}", self._buf, start))
        if itype == _STRING:
            self._count(n, _MIN_STRING, "array items")
            if n > _MAX_ARRAY_READ:
                self._skip_strings(n)
                return None
            return [self._string() for _ in range(n)]
        if itype != _ARRAY:
            raise self._error(f"{self._where} is an array of the unknown value type {itype}")
        self._count(n, _MIN_ARRAY, "array items")
        if n > _MAX_ARRAY_READ:
            raise self._error(f"{self._where}: long nested metadata arrays are not supported")
        if depth >= _MAX_NESTING:
            raise self._error(
                f"{self._where}: arrays nested over {_MAX_NESTING} deep are not supported"
            )
        return [self._value(_ARRAY, depth + 1) for _ in range(n)]

    def _alignment(self) -> int:
        align = self.fields.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise self._error(f"general.alignment must be a power of two, got {align!r}")
        return align

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], ggml_type: int, offset: int
    ) -> GGUFTensor:
        if any(d >= 2**63 for d in dims):
            raise self._error(f"tensor {name!r} has the shape {dims}, a dimension past 2**63")
        n_elems = math.prod(dims)
        dtype = _PLAIN.get(ggml_type)
        if dtype is not None:
            n_bytes = n_elems * dtype.itemsize
        else:
            qname, block, type_size = self._quant_block(name, ggml_type)
            row = dims[0] if dims else 1
            if row % block:
                raise self._error(
                    f"tensor {name!r}: a row of {row} is not a multiple of {qname}'s block of {block}"
                )
            n_bytes = n_elems // block * type_size
        begin = start + offset
        end = begin + n_bytes
        if end > self._size:
            raise GGUFError(
                f"model file {self.path} is truncated or corrupt: tensor {name!r} runs past the "
                f"end of the file (its data ends at byte {end}, the file has {self._size} bytes)"
            )
        raw = self._map[begin:end]
        np_dims = tuple(reversed(dims))
        try:
            if dtype is not None:
                data = raw.view(dtype).reshape(np_dims)
            else:
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        except ValueError as e:  # e.g. a zero dimension beside dimensions NumPy cannot hold
            raise self._error(f"tensor {name!r} has the shape {dims}: {e}") from None
        return GGUFTensor(name, ggml_type, dims, data)

    def _quant_block(self, name: str, ggml_type: int) -> tuple[str, int, int]:
        """A quantized type's name, elements per block and bytes per block."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self._error(f"tensor {name!r} has the unknown ggml type {ggml_type}") from None
        return qtype.name, block, type_size


def _map_file(path: str) -> np.ndarray:
    """The file's bytes, memory-mapped (NumPy cannot map an empty file)."""
    try:
        if os.path.getsize(path) == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise GGUFError(f"cannot read model file {path}: {e.strerror or e}") from None
