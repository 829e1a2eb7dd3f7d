"""Kernels 2 and 3: paged attention over a flat mixed batch, and its split-KV (flash-decoding)
form. Same contract as cbgen.attention.torch_backend.paged_attention:

    query [T, H, D]; kv_cache [2, num_blocks, block_size, Hkv, D]
    sequence i owns query tokens [qsl[i], qsl[i + 1]) and its first seq_lens[i] keys:

        key positions:  0 ............ context_len ............ seq_len
                        |<-- cached context -->|<-- query_len new -->|
        query j of the chunk (0 <= j < query_len) sees keys [0, context_len + j]
        (with a sliding window W > 0: keys (context_len + j - W, context_len + j] only)

    key p of sequence i lives at block block_table[i, p // block_size], offset p % block_size.

A sliding window and logit soft-capping (cbgen.attention.base) are runtime arguments (0: none):
a program starts at its first row's first key, so the blocks before are never read, and scores
s become softcap * tanh(s / softcap) before the mask.

Work split. One program owns a *tile*: BLOCK_Q consecutive query tokens of one sequence and
the GROUP query heads that share one KV head (GQA by head grouping), i.e. BLOCK_M >= BLOCK_Q *
GROUP query rows, row m = (token m // GROUP, head m % GROUP). Every row of a tile reads the
same keys, so K/V are loaded once per tile. The grid is (tiles, Hkv, splits), one launch for
the whole batch. Tiles are numbered without any host-side prefix sum: sequence i owns the
tiles starting at

    first_tile(i) = qsl[i] // BLOCK_Q + i        (= qsl[i] when BLOCK_Q == 1)

which is increasing in i and leaves room for ceil(query_len_i / BLOCK_Q) tiles, so
T // BLOCK_Q + B programs cover every batch; a program finds its sequence by binary search
over qsl and a program past its sequence's last token returns at once.

Inside a program: online softmax over key tiles of BLOCK_N keys gathered through the block
table (a key tile may span several pages), in float32, base 2 (scale folded with log2(e)).

Split-KV (flash-decoding): with num_splits > 1 the keys of each sequence are cut into
num_splits ranges of equal length (a multiple of BLOCK_N); program (tile, head, s) attends to
range s only and writes its normalised partial output and its log-sum-exp. A merge kernel
combines them: out = sum_s exp2(lse_s - max) * out_s / sum_s exp2(lse_s - max). Under a
window the ranges cut [first key of the tile's first row, seq_len) instead. A range a row
cannot see (past its causal limit, or before its window) leaves lse = -inf and weighs nothing;
the range holding the row's own key always has keys it sees, so the merge never divides by
zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cbgen_kernels.rounding import INTERPRETED

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
MASKED = tl.constexpr(-1.0e30)
"""Score of an invisible key: finite, so a row that sees no key in a range yields exp2(0) terms
that the visibility mask zeroes, never inf - inf."""


# Triton compiles a kernel anew for each specialisation of its integer arguments (equal to 1,
# divisible by 16). Those that change from step to step of one model must be exempt, or a run
# recompiles whenever they cross one of those lines: the batch's sequence count, the block
# table's width (it follows the longest context) and the split workspace's strides (they follow
# the step's token count). Strides fixed by the model's shape stay specialised.
# The split count is a run-time argument for the same reason: it follows the batch size and the
# longest context, and a compile per count (5-6 counts per model over the graph buckets on a
# 132-SM GPU) would cost seconds each. Only whether the keys are split (SPLIT) is compiled in.
STEP_DEPENDENT_ARGS = (
    "num_seqs",
    "num_splits",
    "stride_out_split",
    "stride_lse_split",
    "stride_block_table",
)
MERGE_STEP_DEPENDENT_ARGS = ("num_splits", "stride_part_split", "stride_lse_split")
MAX_SPLITS = 16
"""The merge kernel's compiled width: any split count up to this shares one variant."""


@triton.jit(do_not_specialize=STEP_DEPENDENT_ARGS)
def _paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    lse_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    softcap,
    num_seqs,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_out_split,
    stride_out_tok,
    stride_out_head,
    stride_lse_split,
    stride_lse_tok,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # seq = the largest i < num_seqs with first_tile(i) <= tile (first_tile is non-decreasing),
    # by binary search; written inline (a nested jit call is slow under the interpreter).
    seq = num_seqs * 0
    hi = num_seqs - 1
    while seq < hi:
        mid = (seq + hi + 1) // 2
        if BLOCK_Q == 1:
            first_tile = tl.load(query_start_loc_ptr + mid)
        else:
            first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        ok = first_tile <= tile
        seq = tl.where(ok, mid, seq)
        hi = tl.where(ok, hi, mid - 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if BLOCK_Q == 1:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        first_q = tile - q_start
    else:
        first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Rows: token first_q + m // GROUP of the chunk, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < query_len)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # Causal limit of each row: it sees keys [0, q_pos] with q_pos its absolute position, and
    # under a window only those past q_pos - window (past -1 without one).
    q_pos = context_len + q_idx
    q_floor = tl.where(window > 0, q_pos - window, -1)

    # Keys this program visits: [kv_lo, kv_hi). The tile's first row sees from kv_first on,
    # its last row up to context_len + first_q + BLOCK_Q - 1, and nobody past seq_len - 1.
    kv_first = tl.where(window > 0, tl.maximum(context_len + first_q - window + 1, 0), 0)
    kv_end = tl.minimum(seq_len, context_len + first_q + BLOCK_Q)
    if not SPLIT:
        kv_lo = kv_first
        kv_hi = kv_end
    else:
        span = seq_len - kv_first
        per_split = ((span + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        kv_lo = kv_first + split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    cache_head = kv_head.to(tl.int64) * stride_cache_head
    for start in range(kv_lo, kv_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_hi
        block = tl.load(table_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_offs = block * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_slot + cache_head
        k = tl.load(
            key_cache_ptr + kv_offs[None, :] + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [DIM_PAD, BLOCK_N]
        v = tl.load(
            value_cache_ptr + kv_offs[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, DIM_PAD]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        if softcap > 0:
            # in natural units: c * tanh(x / c), tanh(y) = 1 - 2 / (exp(2y) + 1) (no overflow)
            y = s * (1.0 / (LOG2E_C * softcap))
            s = (softcap * LOG2E_C) * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        visible = (
            key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_floor[:, None])
        )
        s = tl.where(visible, s, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_offs = tok[:, None] * stride_out_tok + head[:, None] * stride_out_head + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if not SPLIT:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        split64 = split.to(tl.int64)
        tl.store(out_ptr + split64 * stride_out_split + out_offs, out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(
            lse_ptr + split64 * stride_lse_split + tok * stride_lse_tok + head,
            lse,
            mask=row_ok,
        )


@triton.jit(do_not_specialize=MERGE_STEP_DEPENDENT_ARGS)
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_part_split,
    stride_part_tok,
    stride_part_head,
    stride_lse_split,
    stride_lse_tok,
    stride_out_tok,
    stride_out_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(
        lse_ptr + splits * stride_lse_split + tok * stride_lse_tok + head,
        mask=split_ok,
        other=float("-inf"),
    )
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds key 0: max is finite
    weight = weight / tl.sum(weight, 0)
    parts = tl.load(
        part_ptr
        + splits[:, None].to(tl.int64) * stride_part_split
        + tok * stride_part_tok
        + head * stride_part_head
        + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(
        out_ptr + tok * stride_out_tok + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


# ---- launch configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one launch (see the module docstring)."""

    block_q: int
    """Query tokens per tile."""
    block_m: int
    """Query rows per tile, a power of two >= block_q * group (>= 16 for tl.dot)."""
    block_n: int
    """Keys per inner iteration."""
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int | None = None
    """Software pipelining depth of the key loop (None: Triton's default for the GPU)."""


def choose_config(
    num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int, num_splits: int = 1
) -> LaunchConfig:
    """Decode-only batches get one token per tile (rows = the GQA group); batches with prefill
    chunks get 64-row tiles (fewer programs re-reading the same keys).

    A decode tile runs on 2 warps with a 4-deep key pipeline: on an H200, a Llama-8B-shape
    decode batch (256 sequences, context 512, bf16) read its KV cache in 0.193 ms against
    0.218 ms with 4 warps and Triton's default depth, the best of 36 tiles timed
    (tools.attention_sweep; docs/GPU.md)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    block_n = 64 if head_dim <= 128 else 32
    if max_query_len <= 1:
        # One token per tile: the grid is exactly T and rows past the group are padding.
        block_m = max(16, triton.next_power_of_2(group))
        return LaunchConfig(1, block_m, block_n, num_splits, num_warps=2, num_stages=4)
    block_m = max(64, triton.next_power_of_2(group))
    return LaunchConfig(block_m // group, block_m, block_n, num_splits)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    min_keys_per_split: int = 256,
    max_splits: int = 16,
) -> int:
    """Splits for a decode-only batch: enough programs to give every SM two, but never fewer
    than min_keys_per_split keys per split (short contexts are not worth a merge)."""
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = -(-2 * num_sms // programs)
    room = max(1, max_seq_len // min_keys_per_split)
    return int(max(1, min(want, room, max_splits)))


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-1] != head_dim:
        raise ValueError(
            f"kv_cache of shape {tuple(kv_cache.shape)} does not fit query {tuple(query.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return num_tokens, num_heads, num_kv_heads, head_dim


def _launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cfg: LaunchConfig,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """One launch of the attention kernel; out is [T, H, D] (no split) or [S, T, H, D] float32."""
    num_tokens, num_heads, num_kv_heads, head_dim = _check_inputs(query, kv_cache)
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_tiles = num_tokens if cfg.block_q == 1 else num_tokens // cfg.block_q + num_seqs
    split_out = cfg.num_splits > 1
    lse_t = lse if lse is not None else out  # unused when not split
    _paged_attention_kernel[(num_tiles, num_kv_heads, cfg.num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        lse_t,
        block_table,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        sliding_window or 0,
        float(logit_softcap or 0.0),
        num_seqs,
        cfg.num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0) if split_out else 0,
        out.stride(-3),
        out.stride(-2),
        lse_t.stride(0) if split_out else 0,
        lse_t.stride(1) if split_out else 0,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=kv_cache.shape[2],
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT=split_out,
        # The interpreter computes bfloat16 arithmetic wrongly (numpy has no bfloat16), so
        # there the dot operands are widened to float32 first; products of bf16 values are
        # exact in float32 either way.
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )


def _max_query_len(query_start_loc: torch.Tensor) -> int:
    return (
        int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
        if query_start_loc.numel() > 1
        else 0
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache, one launch for the whole mixed batch.
    max_query_len (host int) picks the tile shape; without it it is read from query_start_loc.
    sliding_window, logit_softcap: as cbgen.attention.base (None: none)."""
    return paged_attention_split_kv(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        num_splits=1,
        max_query_len=max_query_len,
        out=out,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )


@dataclass
class SplitWorkspace:
    """Float32 partial outputs [S, T, H, D] and log-sum-exps [S, T, H] of one split launch;
    reusable by every layer of a step."""

    partial: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def allocate(
        cls, num_splits: int, num_tokens: int, num_heads: int, head_dim: int, device: torch.device
    ) -> SplitWorkspace:
        return cls(
            torch.empty(
                num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=device
            ),
            torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=device),
        )

    def fits(self, num_splits: int, num_tokens: int, num_heads: int, head_dim: int) -> bool:
        return tuple(self.partial.shape) == (num_splits, num_tokens, num_heads, head_dim)


def paged_attention_split_kv(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 4,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    workspace: SplitWorkspace | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention with the keys of every sequence cut into num_splits ranges attended in
    parallel, then merged by log-sum-exp (flash-decoding). Meant for decode-only batches of a
    few long sequences; correct for any batch."""
    num_tokens, num_heads, num_kv_heads, head_dim = _check_inputs(query, kv_cache)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = _max_query_len(query_start_loc)
    cfg = choose_config(num_heads, num_kv_heads, head_dim, max_query_len, num_splits)
    options = (sliding_window, logit_softcap)
    if num_splits == 1:
        _launch(
            query, kv_cache, block_table, query_start_loc, seq_lens, scale, cfg, out, None, *options
        )
        return out
    if workspace is None or not workspace.fits(num_splits, num_tokens, num_heads, head_dim):
        workspace = SplitWorkspace.allocate(
            num_splits, num_tokens, num_heads, head_dim, query.device
        )
    _launch(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        cfg,
        workspace.partial,
        workspace.lse,
        *options,
    )
    part, lse = workspace.partial, workspace.lse
    _merge_splits_kernel[(num_tokens, num_heads)](
        part,
        lse,
        out,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=merge_width(num_splits),
    )
    return out


def merge_width(num_splits: int) -> int:
    """The merge kernel's compiled width for num_splits: MAX_SPLITS up to it (one variant for
    every count the backend picks), the next power of two past it."""
    return max(MAX_SPLITS, triton.next_power_of_2(num_splits))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 elsewhere, for the interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


__all__ = [
    "LaunchConfig",
    "SplitWorkspace",
    "choose_config",
    "choose_num_splits",
    "num_sms",
    "paged_attention",
    "paged_attention_split_kv",
]
