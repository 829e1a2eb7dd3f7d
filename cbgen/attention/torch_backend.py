"""The torch attention backend: the plain reference every other backend and kernel is tested
against, written in torch ops alone, correct on any device.

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

Decodes are attended in one batched SDPA call over their gathered blocks; each prefill chunk
in one SDPA call of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbgen.attention.base import AttentionBackend, AttentionMetadata


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
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, key.to(kv_cache.dtype)
    )
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(kv_cache.dtype)
    )


PrefillChunk = tuple[int, int, int, torch.Tensor]
"""(token_start, token_end, seq_len, block ids) of one prefill chunk in the flat batch."""


@dataclass
class AttentionPlan:
    """Per-step index work shared by every layer (built once per step)."""

    # Decodes (query_len == 1), attended in one batched call.
    decode_tokens: torch.Tensor  # [Bd] token indices in the flat batch
    decode_blocks: torch.Tensor  # [Bd, nb] block ids (0-padded)
    decode_mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] True = attend
    decode_seq_lens: torch.Tensor  # [Bd] int32
    prefills: list[PrefillChunk]
    """Prefill chunks (query_len > 1), one call each."""
    may_have_negative: bool = True
    """Whether slot_mapping may hold negative (skipped) slots."""


def plan_attention(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor | None = None,
) -> AttentionPlan:
    """The step's decodes and prefill chunks; with slot_mapping, whether any slot is negative."""
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
        decode_mask = (torch.arange(nb * block_size, device=device)[None, :] < dec_lens[:, None])[
            :, None, None, :
        ]
        decode_tokens = query_start_loc[rows].long()
        decode_seq_lens = dec_lens
    else:
        decode_seq_lens = torch.empty(0, dtype=torch.int32, device=device)
        decode_blocks = torch.empty(0, 0, dtype=block_table.dtype, device=device)
        decode_mask = torch.empty(0, 1, 1, 0, dtype=torch.bool, device=device)
        decode_tokens = torch.empty(0, dtype=torch.long, device=device)
    may_have_negative = True
    if slot_mapping is not None:
        may_have_negative = bool((slot_mapping < 0).any()) if slot_mapping.numel() else False
    return AttentionPlan(
        decode_tokens, decode_blocks, decode_mask, decode_seq_lens, prefills, may_have_negative
    )


def attend_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write into out [T, H, D] the attention of the plan's decode tokens (one SDPA call)."""
    if not plan.decode_tokens.numel():
        return
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    bd = plan.decode_tokens.shape[0]
    # [Bd, Hkv, G, D]: the G query heads of a KV group act as G query rows.
    q = query[plan.decode_tokens].view(bd, num_kv_heads, group, head_dim)
    k = kv_cache[0][plan.decode_blocks].flatten(1, 2).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = kv_cache[1][plan.decode_blocks].flatten(1, 2).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.decode_mask, scale=scale
    )
    out[plan.decode_tokens] = o.reshape(bd, num_heads, head_dim)


def gather_context(
    kv_cache: torch.Tensor, chunk: PrefillChunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [seq_len, Hkv, D] a prefill chunk attends to, in position order."""
    _, _, seq_len, blocks = chunk
    return kv_cache[0][blocks].flatten(0, 1)[:seq_len], kv_cache[1][blocks].flatten(0, 1)[:seq_len]


def attend_chunk(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk's query [Q, H, D] (positions L - Q .. L - 1) over its keys
    and values [L, Hkv, D]: [Q, H, D]."""
    qlen, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    ctx = seq_len - qlen
    # [1, H, Q, D] against [1, Hkv, L, D]: 4-D inputs take torch's flash kernel on the CPU
    # (3-D ones fall back to its unfused math path, about 4x slower on an 800-token prompt)
    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1)[None].to(q.dtype)
    v = values.transpose(0, 1)[None].to(q.dtype)
    mask = None  # no cached context: the plain causal mask
    if ctx:  # query j (position ctx + j) sees keys k <= ctx + j
        dev = query.device
        mask = (
            torch.arange(seq_len, device=dev)[None, :]
            <= ctx + torch.arange(qlen, device=dev)[:, None]
        )
    o = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads > num_kv_heads,
    )
    return o[0].transpose(0, 1)


def attend(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache, following a plan."""
    out = torch.empty_like(query)
    attend_decodes(query, kv_cache, plan, scale, out)
    for chunk in plan.prefills:
        start, end = chunk[0], chunk[1]
        out[start:end] = attend_chunk(query[start:end], *gather_context(kv_cache, chunk), scale)
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


class TorchAttentionBackend(AttentionBackend):
    """The reference: torch ops only, on any device."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.state = plan_attention(
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_size,
            meta.slot_mapping,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan: AttentionPlan = meta.state
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, plan.may_have_negative)
        return attend(query, kv_cache, plan, scale)
