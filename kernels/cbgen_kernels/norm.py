"""Residual add + RMSNorm in one pass over each row. Same contract as
cbgen.models.ops.TorchOps.add_rmsnorm_:

    residual [T, N] += h [T, N]           (in place, rounded to the dtype; h None: no add)
    out = weight * (r32 * rsqrt(mean(r32^2) + eps)).to(dtype)     r32 = residual in float32

One program per row holds the whole row (N up to MAX_HIDDEN) in registers: one read of
residual and h, one write of residual and out. The roundings are the reference's: the add is
rounded to the dtype before the norm reads it (so the residual stream is bit-identical to
residual + h), the normalised row is rounded to the dtype before the weight multiplies it, and
every float32 operation rounds to nearest (no fused multiply-adds, precise division and square
root). Only the order of the sum of squares differs from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbgen_kernels.rounding import round_to, soft_bf16

MAX_HIDDEN = 65536
"""The longest row one program holds (fp32 registers spread over up to 16 warps)."""


@triton.jit
def _add_rmsnorm_kernel(
    residual_ptr,
    h_ptr,
    weight_ptr,
    out_ptr,
    stride_residual,
    stride_h,
    stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_H: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = residual_ptr.dtype.element_ty
    r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_H:
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        # a sum of two values of the dtype rounded once in float32, then to the dtype: the
        # correctly rounded sum, as the reference's in-place add gives
        r_dt = round_to(r + h, dtype, SOFT_BF16)
        tl.store(residual_ptr + row * stride_residual + cols, r_dt, mask=mask)
        r = r_dt.to(tl.float32)
    mean_sq = tl.div_rn(tl.sum(r * r, axis=0), N)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    y = round_to(r * rstd, dtype, SOFT_BF16).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(w * y, dtype, SOFT_BF16), mask=mask)


def _row_major(x: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(x.shape) != shape:
        raise ValueError(f"add_rmsnorm_: {name} has shape {tuple(x.shape)}, expected {shape}")
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rmsnorm_(
    residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual [T, N] += h (in place; h None: no add), then RMSNorm(residual) * weight [N],
    in residual's dtype (weight and h must share it)."""
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError(
            f"add_rmsnorm_: residual must be [T, N] with contiguous rows, got shape "
            f"{tuple(residual.shape)} strides {residual.stride()}"
        )
    num_rows, n = residual.shape
    if n > MAX_HIDDEN:
        raise ValueError(f"add_rmsnorm_: rows of {n} values exceed the kernel's {MAX_HIDDEN}")
    for name, t in (("h", h), ("weight", weight)):
        if t is not None and t.dtype != residual.dtype:
            raise ValueError(f"add_rmsnorm_: {name} is {t.dtype}, residual is {residual.dtype}")
    weight = _row_major(weight, "weight", (n,))
    if h is not None:
        h = _row_major(h, "h", (num_rows, n))
    out = torch.empty_like(residual)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(num_rows,)](
        residual,
        h if h is not None else residual,
        weight,
        out,
        residual.stride(0),
        h.stride(0) if h is not None else 0,
        out.stride(0),
        eps,
        N=n,
        BLOCK=block,
        HAS_H=h is not None,
        SOFT_BF16=soft_bf16(residual.dtype),
        num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=False,
    )
    return out
