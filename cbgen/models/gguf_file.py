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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# value types: struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_READ = 4096
"""Arrays longer than this are skipped (tokenizer vocabularies, merges, scores)."""


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


class GGUFError(ValueError):
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
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)  # type: ignore[arg-type]
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        n_tensors = self._scalar("<Q")
        n_kv = self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        """Every metadata value; arrays longer than 4096 items are None."""
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
            self._pos += 8 * n_dims
            ggml_type = self._scalar("<I")
            offset = self._scalar("<Q")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        align = int(self.fields.get("general.alignment") or 32)
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---- reading ----------------------------------------------------------------------
    def _scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _skip_string(self) -> None:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        self._pos += 8 + n

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        itype = self._scalar("<I")
        n = self._scalar("<Q")
        if itype in _SCALARS:
            fmt = _SCALARS[itype]
            size = struct.calcsize(fmt)
            if n > _MAX_ARRAY_READ:
                self._pos += size * n
                return None
            values = list(struct.unpack_from(f"<{n}{fmt[1]}", self._buf, self._pos))
            self._pos += size * n
            return values
        if itype == _STRING:
            if n > _MAX_ARRAY_READ:
                for _ in range(n):
                    self._skip_string()
                return None
            return [self._string() for _ in range(n)]
        if n > _MAX_ARRAY_READ:
            raise GGUFError(f"{self.path}: nested metadata arrays are not supported")
        return [self._value(itype) for _ in range(n)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(ggml_type)
        n_elems = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        begin = start + offset
        dtype = _PLAIN.get(ggml_type)
        if dtype is not None:
            n_bytes = n_elems * dtype.itemsize
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            if np_dims[-1] % block:
                raise GGUFError(f"{self.path}: tensor {name}: row of {np_dims[-1]} is not a multiple of {block}")
            n_bytes = n_elems * type_size // block
        if begin + n_bytes > len(self._map):
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        raw = self._map[begin : begin + n_bytes]
        if dtype is not None:
            data = raw.view(dtype).reshape(np_dims)
        else:
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        return GGUFTensor(name, ggml_type, dims, data)
