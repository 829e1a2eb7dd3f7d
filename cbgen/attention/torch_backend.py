"""The torch attention backend: the plain reference every other backend and kernel is tested
against, written in torch ops alone, correct on any device.

Flat mixed batch, B sequences, T tokens in all. Sequence i owns query tokens
[query_start_loc[i], query_start_loc[i + 1]) and attends to its first seq_lens[i] tokens,
read from the paged cache through block_table[i]:

    positions:  0 .............. context_len ........ seq_len
                |<- cached context ->|<- query_len new ->|
    query j (0 <= j < query_len) sees keys [0, context_len + j]   (causal inside the chunk)

With a sliding window W it sees keys (context_len + j - W, context_len + j] only: the blocks
wholly before its chunk's first window are not gathered at all (first_window_block), and the
mask cuts the rest.

A decode is a query of length 1. GQA: query head h reads KV head h // (H / Hkv).

KV cache, per layer: [2, num_blocks, block_size, Hkv, D]; token at position p of a sequence
lives in block block_table[i, p // block_size] at offset p % block_size, i.e. at the flat
slot block * block_size + offset.

Decodes are attended in one batched SDPA call over their gathered blocks; each prefill chunk
in one SDPA call of its own. Logit soft-capping, which SDPA cannot do, takes the plain math
(attention_math) instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def first_window_block(seq_len: int, query_len: int, window: int | None, block_size: int) -> int:
    """The first block a chunk of query_len queries ending at seq_len reads: the block of its
    first query's first key (0 without a window).

        keys:  0 ...... | first block ...... p0 - W + 1 ...... p0 ...... seq_len - 1
                                             ^ first key of the first query, p0 = seq_len - query_len
    """
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1) // block_size


PrefillChunk = tuple[int, int, int, torch.Tensor]
"""(token_start, token_end, seq_len, block ids) of one prefill chunk in the flat batch."""


@dataclass
class DecodeView:
    """The blocks the plan's decodes read under one window and which of their keys count."""

    blocks: torch.Tensor  # [Bd, nb] block ids (0-padded)
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] True = attend


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
    block_size: int = 16
    windowed: dict[int, DecodeView] = field(default_factory=dict)
    """The decodes' view per sliding window, built by the first layer with that window."""

    def decode_view(self, window: int | None) -> DecodeView:
        """What the decodes read under a sliding window (None: all of their blocks)."""
        if window is None or not self.decode_tokens.numel():
            return DecodeView(self.decode_blocks, self.decode_mask)
        view = self.windowed.get(window)
        if view is None:
            view = self.windowed[window] = window_view(
                self.decode_blocks, self.decode_seq_lens, window, self.block_size
            )
        return view


def window_view(
    blocks: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int
) -> DecodeView:
    """Each decode's blocks from its window's first block on, left-aligned, and its mask:

    row:   | b0 | b1 | b2 | b3 | b4 |      seq_len 75, block_size 16, W 20: keys 55..74
    view:            | b3 | b4 |  0 |      (as wide as the widest row needs)
    """
    nb = blocks.shape[1]
    dev = blocks.device
    lens = seq_lens.long()
    first = (lens - window).clamp(min=0) // block_size  # [Bd]
    width = int((-(-lens // block_size) - first).max())
    idx = first[:, None] + torch.arange(width, device=dev)[None, :]  # [Bd, width]
    view_blocks = blocks.gather(1, idx.clamp(max=nb - 1))
    pos = (idx * block_size)[:, :, None] + torch.arange(block_size, device=dev)  # key positions
    pos = pos.flatten(1)
    mask = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
    return DecodeView(view_blocks, mask[:, None, None, :])


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
        decode_tokens,
        decode_blocks,
        decode_mask,
        decode_seq_lens,
        prefills,
        may_have_negative,
        block_size,
    )


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """SDPA with a boolean mask (True = attend; None: causal, as many keys as queries),
    written out so that logit soft-capping can go between the scores and the mask: q
    [..., H, Q, D] against k, v [..., Hkv, L, D], scores and softmax in float32."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:
    """torch's SDPA (mask None: causal), or attention_math where soft-capping is asked."""
    if logit_softcap is not None:
        return attention_math(q, k, v, mask, scale, logit_softcap)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[-3] > k.shape[-3],
    )


def attend_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Write into out [T, H, D] the attention of the plan's decode tokens (one SDPA call)."""
    if not plan.decode_tokens.numel():
        return
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    bd = plan.decode_tokens.shape[0]
    view = plan.decode_view(sliding_window)
    # [Bd, Hkv, G, D]: the G query heads of a KV group act as G query rows.
    q = query[plan.decode_tokens].view(bd, num_kv_heads, group, head_dim)
    k = kv_cache[0][view.blocks].flatten(1, 2).transpose(1, 2)  # [Bd, Hkv, L, D]
    v = kv_cache[1][view.blocks].flatten(1, 2).transpose(1, 2)
    o = _sdpa(q, k.to(q.dtype), v.to(q.dtype), view.mask, scale, logit_softcap)
    out[plan.decode_tokens] = o.reshape(bd, num_heads, head_dim)


def gather_context(
    kv_cache: torch.Tensor, chunk: PrefillChunk, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [L, Hkv, D] a prefill chunk attends to, in position order, from
    first_block on (L = seq_len - first_block * block_size)."""
    _, _, seq_len, blocks = chunk
    skip = first_block * kv_cache.shape[2]
    k = kv_cache[0][blocks[first_block:]].flatten(0, 1)[: seq_len - skip]
    v = kv_cache[1][blocks[first_block:]].flatten(0, 1)[: seq_len - skip]
    return k, v


def attend_chunk(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk's query [Q, H, D] (positions L - Q .. L - 1) over its keys
    and values [L, Hkv, D]: [Q, H, D]. Only positions relative to each other matter, so the
    keys may start anywhere at or before the first query's window."""
    qlen, seq_len = query.shape[0], keys.shape[0]
    ctx = seq_len - qlen
    # [1, H, Q, D] against [1, Hkv, L, D]: 4-D inputs take torch's flash kernel on the CPU
    # (3-D ones fall back to its unfused math path, about 4x slower on an 800-token prompt)
    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1)[None].to(q.dtype)
    v = values.transpose(0, 1)[None].to(q.dtype)
    mask = None  # no cached context, no window cutting in: the plain causal mask
    if ctx or (sliding_window is not None and sliding_window < seq_len):
        # query j (position ctx + j) sees keys k with ctx + j - W < k <= ctx + j
        dev = query.device
        rel = torch.arange(seq_len, device=dev)[None, :] - (
            ctx + torch.arange(qlen, device=dev)[:, None]
        )
        mask = rel <= 0
        if sliding_window is not None:
            mask &= rel > -sliding_window
    return _sdpa(q, k, v, mask, scale, logit_softcap)[0].transpose(0, 1)


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache, following a plan."""
    out = torch.empty_like(query)
    attend_decodes(query, kv_cache, plan, scale, out, sliding_window, logit_softcap)
    for chunk in plan.prefills:
        start, end, seq_len, _ = chunk
        first = first_window_block(seq_len, end - start, sliding_window, plan.block_size)
        keys, values = gather_context(kv_cache, chunk, first)
        out[start:end] = attend_chunk(
            query[start:end], keys, values, scale, sliding_window, logit_softcap
        )
    return out


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache (see the module docstring)."""
    block_size = kv_cache.shape[2]
    plan = plan_attention(block_table, query_start_loc, seq_lens, block_size)
    return attend(query, kv_cache, plan, scale, sliding_window, logit_softcap)


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
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        plan: AttentionPlan = meta.state
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, plan.may_have_negative)
        return attend(query, kv_cache, plan, scale, sliding_window, logit_softcap)
