"""Matmuls over GGUF-quantized weights in their own blocks (cbgen/cpu/csrc/qgemm.c): x float32,
quantized per row to 8-bit blocks of 32 inside the call, the weight repacked once from the
file's blocks into panels of 16 columns (the same bytes). AVX512-VNNI, AVX2 or scalar, chosen
when the kernels are built; every path gives the scalar reference's bits.
"""

from __future__ import annotations

import torch

from cbgen.cpu.build import load_library

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
"""The ggml types executed in their blocks: name -> type id."""
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
"""A file block of 32 weights' bytes, by type id."""
QK = 32
COLS = 16
ISAS = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}


def isa() -> str | None:
    """The path the build's kernels take (None without the kernels)."""
    lib = load_library()
    return None if lib is None else ISAS[int(lib.cbgen_q_isa())]


def supports(type_id: int, n: int, k: int) -> bool:
    """Whether a weight [n, k] of this type runs in its blocks (n a multiple of 16, k of 32)."""
    return type_id in BLOCK_BYTES and n % COLS == 0 and k % QK == 0


def pack(type_id: int, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """The file's rows of blocks (uint8 [n, k / 32 * block bytes]) repacked for q_gemm; None
    without the kernels or where the type or shape is not taken."""
    lib = load_library()
    if lib is None or not supports(type_id, n, k):
        return None
    want = (n, k // QK * BLOCK_BYTES[type_id])
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise ValueError(f"blocks: expected uint8 {want}, got {blocks.dtype} {tuple(blocks.shape)}")
    size = int(lib.cbgen_q_packed_bytes(type_id, n, k))
    out = torch.empty(size, dtype=torch.uint8)
    src = blocks.contiguous()
    if lib.cbgen_q_pack(type_id, src.data_ptr(), n, k, out.data_ptr()):
        return None
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x [M, K] float32 as the kernels quantize it: q int8 [M, K], d float32 [M, K / 32]
    (max|x| / 127 per block) and s int32 [M, K / 32] (the block's sum of q)."""
    lib = load_library()
    if lib is None:
        return None
    x = _rows(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK, dtype=torch.float32)
    s = torch.empty(m, k // QK, dtype=torch.int32)
    lib.cbgen_q8_quantize(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def q_gemm(
    type_id: int,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    reference: bool = False,
) -> torch.Tensor | None:
    """x [M, K] float32 @ W.T (+ bias [n]) for W [n, K] packed by pack; float32 [M, n]. None
    without the kernels or memory. reference: the scalar path (tests)."""
    lib = load_library()
    if lib is None:
        return None
    x = _rows(x)
    m, k = x.shape
    if not supports(type_id, n, k) or packed.numel() != lib.cbgen_q_packed_bytes(type_id, n, k):
        raise ValueError(f"packed: not a packed {n} x {k} weight of type {type_id}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias: expected float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    call = lib.cbgen_q_gemm_ref if reference else lib.cbgen_q_gemm
    rc = call(
        type_id,
        x.data_ptr(),
        m,
        k,
        packed.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        y.data_ptr(),
    )
    return None if rc else y


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % QK:
        raise ValueError(
            f"x: expected float32 [M, K] with K a multiple of {QK}, got {x.dtype} {tuple(x.shape)}"
        )
    return x.contiguous()
