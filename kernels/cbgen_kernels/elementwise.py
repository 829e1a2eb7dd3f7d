"""RoPE in place and SiLU x up: the decoder's element-wise ops that are not a norm. Same
contracts as cbgen.models.ops.TorchOps.rope_ and .silu_mul.

RoPE (rotate_half form). Row t of x holds num_heads heads of head_dim values, then any other
columns (v, when x is a qkv row), which are left alone:

    x[t] = | head 0: x1 | x2 | head 1: x1 | x2 | ... | rest |      x1, x2: head_dim / 2 each
    c, s = cos[positions[t]], sin[positions[t]]  (float32 tables [P, head_dim / 2], rounded to
                                                  x's dtype first, as the reference does)
    x1 <- x1 c - x2 s;   x2 <- x2 c + x1 s       (every product and sum rounded to the dtype)

One program per token rotates all its heads; the tables are gathered in the kernel, so nothing
is built on the host per step. table_rows and rotate_halves, the gather and the rotation, are
shared with cache.rope_write_kv_ (RoPE fused with the K/V write).

SiLU x up over gate_up [T, 2I] = [gate | up] -> [T, I]: silu(gate) is rounded to the dtype
before it multiplies up, as F.silu(gate) * up does. A program covers BLOCK columns of one row.

Every float32 operation rounds to nearest (launched without fused multiply-adds), so RoPE is
bit-identical to the reference; SiLU's exp may differ from torch's in the last float32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbgen_kernels.rounding import round_to, soft_bf16

SILU_BLOCK = 1024
"""Columns of up (and gate) per SiLU program."""


@triton.jit
def table_rows(
    cos_ptr, sin_ptr, offset, dims, dim_mask, dtype: tl.constexpr, SOFT_BF16: tl.constexpr
):
    """cos and sin at one position (the row at offset of the float32 tables), rounded to dtype
    as the reference does, as float32 [1, HALF_PAD]."""
    c = tl.load(cos_ptr + offset + dims, mask=dim_mask, other=0.0)
    s = tl.load(sin_ptr + offset + dims, mask=dim_mask, other=0.0)
    c = round_to(c, dtype, SOFT_BF16).to(tl.float32)[None, :]
    s = round_to(s, dtype, SOFT_BF16).to(tl.float32)[None, :]
    return c, s


@triton.jit
def rotate_halves(
    first, HALF: tl.constexpr, c, s, mask, dtype: tl.constexpr, SOFT_BF16: tl.constexpr
):
    """The rotated halves (x1 c - x2 s, x2 c + x1 s) of the heads whose first halves start at
    the pointers `first` (second halves HALF further), each product and sum rounded to dtype;
    c, s: the tables' rows, already rounded to dtype, as float32 [1, HALF_PAD]."""
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    x1_cos = round_to(x1 * c, dtype, SOFT_BF16).to(tl.float32)
    x2_sin = round_to(x2 * s, dtype, SOFT_BF16).to(tl.float32)
    x2_cos = round_to(x2 * c, dtype, SOFT_BF16).to(tl.float32)
    x1_sin = round_to(x1 * s, dtype, SOFT_BF16).to(tl.float32)
    return round_to(x1_cos - x2_sin, dtype, SOFT_BF16), round_to(x2_cos + x1_sin, dtype, SOFT_BF16)


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x,
    stride_table,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    dim_mask = dims < HALF
    c, s = table_rows(cos_ptr, sin_ptr, pos * stride_table, dims, dim_mask, dtype, SOFT_BF16)
    mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    first = x_ptr + tok * stride_x + heads[:, None] * HEAD_DIM + dims[None, :]
    y1, y2 = rotate_halves(first, HALF, c, s, mask, dtype, SOFT_BF16)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)


def check_rope(
    op: str,
    x: torch.Tensor,
    columns: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Raise ValueError, naming op, unless x is [T, >= columns] with contiguous rows, positions
    [T], and cos, sin [P, R / 2] tables with 0 < R <= head_dim (even)."""
    if x.dim() != 2 or x.shape[1] < columns or x.stride(-1) != 1:
        raise ValueError(
            f"{op}: x must be [T, >= {columns}] with contiguous rows, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if head_dim % 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[-1] <= head_dim:
        raise ValueError(f"{op}: tables of shape {tuple(cos.shape)} do not fit head_dim {head_dim}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"{op}: positions of shape {tuple(positions.shape)} for {x.shape[0]} rows")


def rope_(
    x: torch.Tensor,
    num_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate the first num_heads * head_dim columns of every row of x [T, >= that] (rows may
    be strided) in place, at positions [T], from the float32 tables cos, sin [P, R / 2]: the
    first R dims of each head (R = head_dim, or fewer under partial rotary)."""
    check_rope("rope_", x, num_heads * head_dim, head_dim, positions, cos, sin)
    if x.shape[0] == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    half = cos.shape[-1]
    _rope_kernel[(x.shape[0],)](
        x,
        positions.contiguous(),
        cos,
        sin,
        x.stride(0),
        cos.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF_PAD=triton.next_power_of_2(half),
        SOFT_BF16=soft_bf16(x.dtype),
        num_warps=4 if num_heads * head_dim <= 4096 else 8,
        enable_fp_fusion=False,
    )


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = gate_up_ptr + row * stride_gate_up + cols
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + INTER, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype, SOFT_BF16).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(silu * u, dtype, SOFT_BF16), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] = [gate | up] -> [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_rows, inter)
    if num_rows == 0 or inter == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTER=inter,
        BLOCK=block,
        SOFT_BF16=soft_bf16(gate_up.dtype),
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
