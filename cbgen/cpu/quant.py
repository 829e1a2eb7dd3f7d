"""Matmuls over GGUF-quantized weights in their own blocks (cbgen/cpu/csrc/qgemm.c): x float32,
quantized per row to 8-bit blocks of 32 inside the call, the weight repacked once from the
file's blocks into panels of 16 columns (the file's bytes; the K-quants' packed 6-bit scales
unpacked to bytes). AVX512-VNNI, AVX2 or scalar, chosen when the kernels are built; every path
gives the scalar reference's bits.
"""

from __future__ import annotations

import ctypes

import torch

from cbgen.cpu import build
from cbgen.cpu.arena import WEIGHTS

TYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}
"""The ggml types executed in their blocks: name -> type id."""
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)} | {
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
"""Per type id: (weights, bytes) of a file block."""
QK = 32
COLS = 16
MAX_SEGMENTS = 8
ISAS = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}


def isa() -> str | None:
    """The path the build's kernels take (None without the kernels)."""
    lib = build.load_library()
    return None if lib is None else ISAS[int(lib.cbgen_q_isa())]


def supports(type_id: int, n: int, k: int) -> bool:
    """Whether a weight [n, k] of this type runs in its blocks (n a multiple of 16, k of the
    type's block: 32, or 256 for the K-quants)."""
    return type_id in BLOCKS and n > 0 and n % COLS == 0 and k > 0 and k % BLOCKS[type_id][0] == 0


def pack(type_id: int, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """The file's rows of blocks (uint8 [n, k / block weights * block bytes]) repacked for q_gemm
    (in huge pages where the OS gives them: cbgen.cpu.arena); None without the kernels or where
    the type or shape is not taken."""
    lib = build.load_library()
    if lib is None or not supports(type_id, n, k):
        return None
    weights, size = BLOCKS[type_id]
    want = (n, k // weights * size)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise ValueError(f"blocks: expected uint8 {want}, got {blocks.dtype} {tuple(blocks.shape)}")
    size = int(lib.cbgen_q_packed_bytes(type_id, n, k))
    out = WEIGHTS.empty(size, torch.uint8)
    src = blocks.contiguous()
    if lib.cbgen_q_pack(type_id, src.data_ptr(), n, k, out.data_ptr()):
        return None
    return out


def quantize_rows(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [M, K] float32 as the kernels quantize it: q int8 [M, K], d float32 [M, K / 32]
    (max|x| / 127 per block), s int32 [M, K / 32] (the block's sum of q) and l int32 (the sum
    of its first 16)."""
    lib = build.load_library()
    if lib is None:
        return None
    x = _rows(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK, dtype=torch.float32)
    s = torch.empty(m, k // QK, dtype=torch.int32)
    low = torch.empty(m, k // QK, dtype=torch.int32)
    lib.cbgen_q8_quantize(
        x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr(), low.data_ptr()
    )
    return q, d, s, low


_I64P = ctypes.POINTER(ctypes.c_int64)


class QWeight(ctypes.Structure):
    """csrc/cbgen.h's cbgen_qweight: a PackedWeight's segments as the one-call decoder reads
    them (decoder.c, weights 3)."""

    _fields_ = [
        ("nseg", ctypes.c_int64),
        ("types", _I64P),
        ("weights", _I64P),
        ("rows", _I64P),
    ]


class PackedWeight:
    """A weight for q_gemm: segments side by side, each (type id, bytes packed by pack, rows),
    as a fused layer's parts (q, k, v; gate, up) come in their own types; x is quantized once
    for all of them."""

    def __init__(self, segments: list[tuple[int, torch.Tensor, int]], k: int) -> None:
        lib = build.load_library()
        if lib is None:
            raise RuntimeError("quantized weights: the CPU kernels are not built")
        if not 0 < len(segments) <= MAX_SEGMENTS:
            raise ValueError(f"segments: 1 to {MAX_SEGMENTS}, got {len(segments)}")
        for type_id, packed, n in segments:
            if not supports(type_id, n, k) or packed.numel() != lib.cbgen_q_packed_bytes(
                type_id, n, k
            ):
                raise ValueError(f"packed: not a packed {n} x {k} weight of type {type_id}")
        self._lib = lib
        self.segments = segments
        self.k = k
        self.n = sum(rows for _, _, rows in segments)
        self._table = torch.tensor(
            [[t, p.data_ptr(), rows] for t, p, rows in segments], dtype=torch.int64
        ).T.contiguous()
        """Per segment: type ids, the packed bytes' addresses, rows (the C call's arrays)."""
        table = [ctypes.cast(row.data_ptr(), _I64P) for row in self._table]
        self.descriptor = QWeight(len(segments), *table)
        """The segments for the one-call decoder (it points into _table)."""

    @property
    def types(self) -> list[int]:
        return [t for t, _, _ in self.segments]

    def nbytes(self) -> int:
        return sum(p.numel() for _, p, _ in self.segments)

    def gemm(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, reference: bool = False
    ) -> torch.Tensor | None:
        """x [M, K] float32 @ W.T (+ bias [n]): float32 [M, n]. None without memory for x's
        quantized copy. reference: the scalar path (tests)."""
        x = _rows(x)
        m, k = x.shape
        if k != self.k:
            raise ValueError(f"x: expected {self.k} columns, got {k}")
        n = self.n
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise ValueError(f"bias: expected float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
        y = torch.empty(m, n, dtype=torch.float32)
        b = None if bias is None else bias.contiguous()
        rc = self._lib.cbgen_q_gemm(
            len(self.segments),
            self._table[0].data_ptr(),
            self._table[1].data_ptr(),
            self._table[2].data_ptr(),
            x.data_ptr(),
            m,
            k,
            None if b is None else b.data_ptr(),
            y.data_ptr(),
            int(reference),
        )
        return None if rc else y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (int64, any shape) of a one-segment weight dequantized: float32 [*ids.shape,
        k], the gguf package's values bit for bit (an embedding kept in its blocks)."""
        if len(self.segments) != 1:
            raise ValueError("rows: a weight of one segment")
        type_id, packed, n = self.segments[0]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.k, dtype=torch.float32)
        rc = self._lib.cbgen_q_rows(
            type_id, packed.data_ptr(), n, self.k, flat.data_ptr(), flat.numel(), out.data_ptr()
        )
        if rc:
            raise IndexError(f"rows: ids outside [0, {n})")
        return out.reshape(*ids.shape, self.k)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % QK:
        raise ValueError(
            f"x: expected float32 [M, K] with K a multiple of {QK}, got {x.dtype} {tuple(x.shape)}"
        )
    return x.contiguous()
