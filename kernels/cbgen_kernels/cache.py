"""Kernel 1: write new K/V into the paged cache through slot_mapping.

    key, value       [T, Hkv, D]   (any token/head strides, last dim contiguous)
    kv_cache         [2, num_blocks, block_size, Hkv, D]
    slot_mapping[t]  flat slot = block * block_size + offset, or < 0 to skip token t

One program per token copies its Hkv x D values for K and for V. A negative slot (a padded
entry) writes nothing, so padding is harmless. Same contract as
cbgen.attention.torch_backend.write_kv_cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
