"""The torch attention backend: the reference every kernel is tested against, and the CPU path.

Flat mixed batch, B sequences, T tokens in all. Sequence i owns query tokens
[query_start_loc[i], query_start_loc[i + 1]) and attends to its first seq_lens[i] tokens,
read from the paged cache through block_table[i]:

    positions:  0 .............. context_len ........ seq_len
                |<- cached context ->|<- query_len new ->|
    query j (0 <= j < query_len) sees keys [0, context_len + j]   (causal inside the chunk)

A decode is a query of length 1. GQA: query head h reads KV head h // (H / Hkv).

KV cache, per layer: [2, num_blocks, block_size, Hkv, D]; token at position p of a sequence
lives in block block_table[i, p // block_size] at offset p % block_size, i.e. at the flat
slot block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    may_have_negative: bool = True,
) -> None:
    """Write key/value [T, Hkv, D] at flat slots [T] of kv_cache; negative slots are skipped.

    may_have_negative=False skips the check (the caller knows every slot is real)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if may_have_negative and slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


@dataclass
class AttentionPlan:
    """Per-step index work shared by every layer (built once per step)."""

    # Decodes (query_len == 1), attended in one batched call.
    decode_tokens: torch.Tensor  # [Bd] token indices in the flat batch
    decode_blocks: torch.Tensor  # [Bd, nb] block ids (0-padded)
    decode_mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] True = attend
    decode_seq_lens: torch.Tensor  # [Bd] int32
    # Prefill chunks (query_len > 1), one call each: (token_start, token_end, seq_len, blocks)
    prefills: list[tuple[int, int, int, torch.Tensor]]
    native: NativePlan | None = None
    """For the C kernel (CPU): built when plan_attention is asked for it."""


@dataclass
class NativePlan:
    """Work for the C decode kernel: every decode, and every token of the prefill chunks
    small enough that reading their context once per query token beats a separate SDPA call
    (query token j of a chunk is a one-token query over seq_len - query_len + j + 1 keys).
    Tokens are in flat-batch order, so when all are covered, row i is token i."""

    tokens: torch.Tensor  # [N] token indices in the flat batch
    blocks: torch.Tensor  # [N, nb] int32 block table row of each token's sequence
    seq_lens: torch.Tensor  # [N] int32 keys each token sees
    prefills: list[tuple[int, int, int, torch.Tensor]]
    """The prefill chunks left to SDPA."""


NATIVE_PREFILL_ROWS = 8192
"""A prefill chunk goes to the C kernel when its query tokens read at most this many K/V
rows in all (query_len x mean keys per query); past that, one SDPA call is cheaper than the
kernel's per-token reads (a call costs about as much as 8k rows here)."""


def plan_attention(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    native: bool = False,
) -> AttentionPlan:
    device = block_table.device
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    prefills = []
    for i in range(len(lens)):
        qlen = qsl[i + 1] - qsl[i]
        if qlen > 1:
            seq_len = lens[i]
            nb = -(-seq_len // block_size)
            prefills.append((qsl[i], qsl[i + 1], seq_len, block_table[i, :nb]))
    if decode_rows:
        rows = torch.tensor(decode_rows, device=device)
        dec_lens = seq_lens[rows]
        nb = -(-max(lens[i] for i in decode_rows) // block_size)
        decode_blocks = block_table[rows, :nb]
        decode_mask = (
            torch.arange(nb * block_size, device=device)[None, :] < dec_lens[:, None]
        )[:, None, None, :]
        decode_tokens = query_start_loc[rows].long()
        decode_seq_lens = dec_lens
    else:
        decode_seq_lens = torch.empty(0, dtype=torch.int32, device=device)
        decode_blocks = torch.empty(0, 0, dtype=block_table.dtype, device=device)
        decode_mask = torch.empty(0, 1, 1, 0, dtype=torch.bool, device=device)
        decode_tokens = torch.empty(0, dtype=torch.long, device=device)
    plan = AttentionPlan(decode_tokens, decode_blocks, decode_mask, decode_seq_lens, prefills)
    if native:
        plan.native = _native_plan(block_table, qsl, lens, block_size, prefills)
    return plan


def _native_plan(
    block_table: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    block_size: int,
    prefills: list[tuple[int, int, int, torch.Tensor]],
) -> NativePlan:
    left = {p[0]: p for p in prefills}
    tokens, rows, keys = [], [], []
    max_len = 0
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        qlen = end - start
        if qlen == 0:
            continue
        if qlen > 1:
            if qlen * (seq_len - qlen / 2) > NATIVE_PREFILL_ROWS:
                continue
            del left[start]
        tokens.append(np.arange(start, end))
        rows.append(np.full(qlen, i))
        keys.append(np.arange(seq_len - qlen + 1, seq_len + 1))
        max_len = max(max_len, seq_len)
    device = block_table.device
    if not tokens:
        return NativePlan(
            torch.empty(0, dtype=torch.long, device=device),
            torch.empty(0, 0, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            list(left.values()),
        )
    row_idx = torch.from_numpy(np.concatenate(rows)).to(device)
    nb = -(-max_len // block_size)
    return NativePlan(
        torch.from_numpy(np.concatenate(tokens)).to(device),
        block_table[row_idx, :nb].to(torch.int32),
        torch.from_numpy(np.concatenate(keys).astype(np.int32)).to(device),
        list(left.values()),
    )


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    native: bool = False,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache, following a plan.

    native: on the CPU in float32, attend decodes (and small prefill chunks) with the C decode
    kernel (native.py) straight from the block table instead of gathering K/V, and larger
    prefill chunks with the C prefill kernel over their gathered K/V instead of torch's SDPA;
    the pure-torch path stays the reference."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    decoded = False
    prefills = plan.prefills
    nat = plan.native
    if native and nat is not None and query.dtype == kv_cache.dtype == torch.float32:
        from cbgen.attention.native import paged_decode_f32

        all_native = nat.tokens.shape[0] == num_tokens  # then row i is token i
        o = None
        if nat.tokens.numel():
            o = paged_decode_f32(
                query if all_native else query[nat.tokens], kv_cache, nat.blocks, nat.seq_lens, scale
            )
        if o is not None or not nat.tokens.numel():
            if all_native and o is not None:
                return o
            if o is not None:
                out[nat.tokens] = o
            decoded = True
            prefills = nat.prefills
    if plan.decode_tokens.numel() and not decoded:
        bd = plan.decode_tokens.shape[0]
        # [Bd, Hkv, G, D]: the G query heads of a KV group act as G query rows.
        q = query[plan.decode_tokens].view(bd, num_kv_heads, group, head_dim)
        k = key_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)  # [Bd, Hkv, L, D]
        v = value_cache[plan.decode_blocks].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.decode_mask, scale=scale
        )
        out[plan.decode_tokens] = o.reshape(bd, num_heads, head_dim)
    prefill_kernel = native and bool(prefills) and query.dtype == kv_cache.dtype == torch.float32
    if prefill_kernel:
        from cbgen.attention.native import prefill_attention_f32
    for start, end, seq_len, blocks in prefills:
        qlen = end - start
        ctx = seq_len - qlen
        keys = key_cache[blocks].flatten(0, 1)[:seq_len]  # [L, Hkv, D], gathered
        values = value_cache[blocks].flatten(0, 1)[:seq_len]
        if prefill_kernel:
            o = prefill_attention_f32(query[start:end], keys, values, scale)
            if o is not None:
                out[start:end] = o
                continue
        # [1, H, Q, D] against [1, Hkv, L, D]: 4-D inputs take torch's flash kernel on the CPU
        # (3-D ones fall back to its unfused math path, about 4x slower on an 800-token prompt)
        q = query[start:end].transpose(0, 1)[None]
        k = keys.transpose(0, 1)[None].to(q.dtype)
        v = values.transpose(0, 1)[None].to(q.dtype)
        mask = None  # no cached context: the plain causal mask
        if ctx:  # query j (position ctx + j) sees keys k <= ctx + j
            dev = query.device
            mask = torch.arange(seq_len, device=dev)[None, :] <= ctx + torch.arange(qlen, device=dev)[:, None]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache (see the module docstring)."""
    block_size = kv_cache.shape[2]
    plan = plan_attention(block_table, query_start_loc, seq_lens, block_size)
    return attend(query, kv_cache, plan, scale)
