"""Kernel 1: write new K/V into the paged cache through slot_mapping; and the same write fused
with RoPE on the q and k heads of the QKV projection's rows.

    key, value       [T, Hkv, D]   (any token/head strides, last dim contiguous)
    kv_cache         [2, num_blocks, block_size, Hkv, D]
    slot_mapping[t]  flat slot = block * block_size + offset, or < 0 to skip token t

One program per token copies its Hkv x D values for K and for V. A negative slot (a padded
entry) writes nothing, so padding is harmless. Same contract as
cbgen.attention.torch_backend.write_kv_cache.

rope_write_kv_ is rope_ (cbgen_kernels.elementwise) on the q and k heads of each qkv row, then
this write of the rotated k and of v, in one launch: one program per token rotates its q heads,
then its k heads, which it stores both in place (attention reads q, and the torch backends k,
from qkv) and into the cache, with v. A negative slot still rotates, and writes no cache.

    qkv[t] = | q: num_heads x D | k: num_kv_heads x D | v: num_kv_heads x D | (D = head_dim)
    each head = | x1: R/2 | x2: R/2 | pass-through: D - R |    (R < D under partial rotary)

The values stored are those of rope_ followed by write_kv_cache, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbgen_kernels.elementwise import check_rope, rotate_halves, table_rows
from cbgen_kernels.rounding import soft_bf16


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = block * stride_cache_block + offset * stride_cache_slot
    dst_offs = dst + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(
        key_ptr + tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    tl.store(key_cache_ptr + dst_offs, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(
        value_ptr + tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    tl.store(value_cache_ptr + dst_offs, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] at flat slots [T] of kv_cache; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_cache.shape[-2:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"write_kv_cache: key {tuple(key.shape)}, value {tuple(value.shape)} do not fit "
            f"a cache of {tuple(kv_cache.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
    )


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_qkv,
    stride_table,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    c, s = table_rows(cos_ptr, sin_ptr, pos * stride_table, dims, dim_mask, dtype, SOFT_BF16)
    row = qkv_ptr + tok * stride_qkv
    # q: rotated in place
    heads = tl.arange(0, HEADS_PAD)
    q_mask = (heads[:, None] < NUM_HEADS) & dim_mask[None, :]
    q = row + heads[:, None] * HEAD_DIM + dims[None, :]
    q1, q2 = rotate_halves(q, HALF, c, s, q_mask, dtype, SOFT_BF16)
    tl.store(q, q1, mask=q_mask)
    tl.store(q + HALF, q2, mask=q_mask)
    # k: rotated in place, and with v into the cache unless the slot is padding
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    k_row = row + NUM_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM
    k_mask = (kv_heads[:, None] < NUM_KV_HEADS) & dim_mask[None, :]
    k1, k2 = rotate_halves(k_row + dims[None, :], HALF, c, s, k_mask, dtype, SOFT_BF16)
    tl.store(k_row + dims[None, :], k1, mask=k_mask)
    tl.store(k_row + HALF + dims[None, :], k2, mask=k_mask)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        cache_dtype = key_cache_ptr.dtype.element_ty
        dst = (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_slot
        dst += kv_heads[:, None] * stride_cache_head
        tl.store(key_cache_ptr + dst + dims[None, :], k1.to(cache_dtype), mask=k_mask)
        tl.store(key_cache_ptr + dst + HALF + dims[None, :], k2.to(cache_dtype), mask=k_mask)
        full = tl.arange(0, DIM_PAD)[None, :]
        head_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (full < HEAD_DIM)
        if 2 * HALF < HEAD_DIM:  # partial rotary: the dims past R pass through
            tail_mask = head_mask & (full >= 2 * HALF)
            tail = tl.load(k_row + full, mask=tail_mask)
            tl.store(key_cache_ptr + dst + full, tail.to(cache_dtype), mask=tail_mask)
        v = tl.load(k_row + NUM_KV_HEADS * HEAD_DIM + full, mask=head_mask)
        tl.store(
            value_cache_ptr + dst + full, v.to(value_cache_ptr.dtype.element_ty), mask=head_mask
        )


def rope_write_kv_(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """rope_(qkv, num_heads + num_kv_heads, head_dim, positions, cos, sin), then
    write_kv_cache(k, v, kv_cache, slot_mapping) of the rotated k heads and the v heads of
    qkv [T, >= (num_heads + 2 num_kv_heads) * head_dim] (rows may be strided), in one launch."""
    columns = (num_heads + 2 * num_kv_heads) * head_dim
    check_rope("rope_write_kv_", qkv, columns, head_dim, positions, cos, sin)
    if kv_cache.shape[-2:] != (num_kv_heads, head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"rope_write_kv_: a cache of shape {tuple(kv_cache.shape)} strides "
            f"{kv_cache.stride()} does not take {num_kv_heads} KV heads of {head_dim}"
        )
    if slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(
            f"rope_write_kv_: slot_mapping of shape {tuple(slot_mapping.shape)} for "
            f"{qkv.shape[0]} rows"
        )
    if qkv.shape[0] == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    half = cos.shape[-1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _rope_write_kv_kernel[(qkv.shape[0],)](
        qkv,
        positions.contiguous(),
        cos,
        sin,
        key_cache,
        value_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
        SOFT_BF16=soft_bf16(qkv.dtype),
        num_warps=4 if (num_heads + num_kv_heads) * head_dim <= 4096 else 8,
        enable_fp_fusion=False,
    )
