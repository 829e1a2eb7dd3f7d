"""Check a safetensors file's header before its tensors are loaded: the header length, its
JSON, and each tensor's dtype, shape and data range against the file size. Only the header is
read, so a broken file (truncated, corrupt, of a dtype cbgen does not load) fails at once with
one line naming it, before any weights are copied.

Layout: a u64 little-endian header length N; N bytes of JSON, {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}; then the data, offsets counted from
byte 8 + N.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from cbgen.models.errors import ModelFileError

_MAX_HEADER = 100_000_000
"""The safetensors library's own limit on the header's length."""
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
"""The dtypes cbgen loads weights from, and their sizes."""


def check_safetensors(path: Path) -> None:
    """Raise ModelFileError naming the file and the problem unless its header is sound."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(
                    f"model file {path} is truncated: it has {size} bytes, not even the 8 "
                    "of the header's length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise ModelFileError(
                    f"model file {path}: the header length {n} is over safetensors' limit "
                    f"of {_MAX_HEADER} bytes"
                )
            if 8 + n > size:
                raise ModelFileError(
                    f"model file {path} is truncated or corrupt: its header ends at byte "
                    f"{8 + n}, the file has {size} bytes"
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFileError(f"model file {path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"model file {path}: the header is not a JSON object")
    data_start = 8 + n
    for name, info in header.items():
        if name != "__metadata__":
            _check_tensor(path, name, info, data_start, size)


def _check_tensor(path: Path, name: str, info: Any, data_start: int, size: int) -> None:
    where = f"model file {path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ModelFileError(f"{where} is not described by a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ModelFileError(
            f"{where} has the dtype {dtype!r}; cbgen loads {', '.join(_DTYPE_BYTES)} weights"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ModelFileError(f"{where} has the shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ModelFileError(f"{where} has the data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if data_start + end > size:
        raise ModelFileError(
            f"model file {path} is truncated or corrupt: tensor {name!r} ends at byte {data_start + end}, "
            f"the file has {size} bytes"
        )
    needed = math.prod(shape) * _DTYPE_BYTES[dtype]
    if end - begin != needed:
        raise ModelFileError(
            f"{where}: its {dtype} shape {shape} needs {needed} bytes, its data_offsets cover {end - begin}"
        )
