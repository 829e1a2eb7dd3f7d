"""Grouped expert MLPs of a mixture-of-experts layer. Same contract as the torch reference
cbgen.models.moe.grouped_experts:

    x [T, H]; token_rows [S]: the token each row reads; expert_offsets [E + 1]: rows
    offsets[e] .. offsets[e + 1] belong to expert e; w_gate_up [E, 2I, H] (gate rows, then up
    rows); w_down [E, H, I]  ->  out [S, H], row r = down_e(silu(gate_e x) * up_e x), x = x[token_rows[r]]

Two launches of one grouped matmul kernel: gate-up with SiLU x up in its epilogue (gathering the
tokens' rows of x), then down over those products. Work comes in tiles of BLOCK_M rows of one
expert, listed on the device from the offsets (no host read, so a step can be captured in a
CUDA graph):

    rows:   | expert 0: 37 rows     | expert 1: 0 | expert 2: 5 |
    tiles:  | t0 (16) t1 (16) t2 (5) |             | t3 (5)      | t4 ... surplus: return at once

    tiles of expert e = cdiv(count_e, BLOCK_M); the grid has cdiv(S, BLOCK_M) + E tiles, which
    is never fewer than needed.

Each tile's products accumulate in float32 (float32 inputs: IEEE products, no TF32) and are
rounded to the dtype where the reference rounds: gate and up, silu(gate), silu(gate) * up, and
the down projection. The sums run in another order than torch's matmul, so results agree to
rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbgen_kernels.rounding import INTERPRETED, round_to, soft_bf16

BLOCK_M = 16
"""Rows of one expert per tile (tl.dot's smallest)."""


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    a_rows_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    offsets_ptr,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    NUM_EXPERTS: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    GATHER: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """out[r, n] = sum_k a[row r, k] * w[e, n, k] for the rows r of this tile (expert e);
    GATED: silu(that) * (the same over w's rows N + n), w being [E, 2N, K]; GATHER: row r of a
    is a[a_rows[r]]."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= NUM_EXPERTS:
        return
    dtype = out_ptr.dtype.element_ty
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(offsets_ptr + expert + 1)
    if GATHER:
        a_rows = tl.load(a_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_offs = cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N], w transposed
        w = tl.load(w_base + w_offs, mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_base + N * stride_wn + w_offs, mask=w_mask, other=0.0)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    out = round_to(acc, dtype, SOFT_BF16)
    if GATED:
        gate = out.to(tl.float32)
        up = round_to(acc_up, dtype, SOFT_BF16).to(tl.float32)
        silu = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype, SOFT_BF16).to(tl.float32)
        out = round_to(silu * up, dtype, SOFT_BF16)
    out_offs = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptr + out_offs, out, mask=row_ok[:, None] & col_ok[None, :])


def _tiles(expert_offsets: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's expert (NUM_EXPERTS for a surplus tile) and first row, on the device."""
    num_experts = expert_offsets.shape[0] - 1
    offsets = expert_offsets.to(torch.int64)
    tiles = (offsets[1:] - offsets[:-1] + BLOCK_M - 1) // BLOCK_M  # [E]
    tile_end = tiles.cumsum(0)
    ids = torch.arange(triton.cdiv(num_rows, BLOCK_M) + num_experts, device=offsets.device)
    expert = torch.searchsorted(tile_end, ids, right=True)  # [tiles], E past the last
    e = expert.clamp(max=num_experts - 1)
    start = offsets[e] + (ids - (tile_end - tiles)[e]) * BLOCK_M
    return expert.to(torch.int32), start.to(torch.int32)


def _grouped_matmul(
    a: torch.Tensor,
    a_rows: torch.Tensor | None,
    w: torch.Tensor,
    n: int,
    out: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    expert_offsets: torch.Tensor,
    gated: bool,
) -> None:
    k = a.shape[1]
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    tile_expert, tile_start = tiles
    _grouped_matmul_kernel[(tile_expert.shape[0], triton.cdiv(n, block_n))](
        a,
        a_rows if a_rows is not None else tile_start,  # unread without GATHER
        w,
        out,
        tile_expert,
        tile_start,
        expert_offsets,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        NUM_EXPERTS=w.shape[0],
        N=n,
        K=k,
        GATHER=a_rows is not None,
        GATED=gated,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # The interpreter computes bfloat16 arithmetic wrongly (numpy has no bfloat16), so there
        # the dot operands are widened to float32 first; products of bf16 values are exact in
        # float32 either way.
        UPCAST=INTERPRETED and a.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        SOFT_BF16=soft_bf16(out.dtype),
        num_warps=4,
        enable_fp_fusion=False,
    )


def grouped_moe(
    x: torch.Tensor,
    token_rows: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Row r of the result [S, H] is expert e's MLP of x[token_rows[r]], for
    expert_offsets[e] <= r < expert_offsets[e + 1] (see the module's docstring)."""
    num_experts, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(-1) != 1:
        raise ValueError(
            f"grouped_moe: x must be [T, {hidden}] with contiguous rows, got {tuple(x.shape)}"
        )
    if tuple(w_down.shape) != (num_experts, hidden, inter) or two_inter % 2:
        raise ValueError(
            f"grouped_moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} "
            "are not [E, 2I, H] and [E, H, I]"
        )
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(
            f"grouped_moe: x is {x.dtype}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}"
        )
    if expert_offsets.shape != (num_experts + 1,) or token_rows.dim() != 1:
        raise ValueError(
            f"grouped_moe: {tuple(expert_offsets.shape)} offsets for {num_experts} experts"
        )
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    num_rows = token_rows.shape[0]
    out = x.new_empty(num_rows, hidden)
    if num_rows == 0:
        return out
    offsets = expert_offsets.contiguous()
    tiles = _tiles(offsets, num_rows)
    products = x.new_empty(num_rows, inter)
    _grouped_matmul(x, token_rows.contiguous(), w_gate_up, inter, products, tiles, offsets, True)
    _grouped_matmul(products, None, w_down, hidden, out, tiles, offsets, False)
    return out
