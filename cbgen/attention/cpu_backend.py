"""The cpu attention backend: the torch reference's plan, with the C kernels of
cbgen.cpu.kernels doing the work in float32 (the auto choice on the CPU), over a float32 KV
cache or a bfloat16 one (--kv-cache-dtype: its values widened to float32 as they are read).

    new K/V             kernels.write_kv_f32: one C call from the strided K/V views of the
                        fused qkv rows
    decodes             the C decode kernel straight from the block table, one query token
                        at a time: no gather of K/V
    prompt chunks       the C prefill kernel over the chunk's gathered K/V, however small the
                        chunk (a prompt's last token alone included: the step marks prompt
                        rows, AttentionMetadata.prompts); over a bf16 cache with
                        bf16_dot_products (--dtype bfloat16 where the CPU has them), its bf16
                        form: bf16 dot products on the cache's rows as they are, the query and
                        the probabilities rounded to bf16

Batch invariance: a prompt token always takes the prefill kernel and a decode the decode
kernel, and the prefill kernel gives each query row the same bits whichever chunk it is in
(its softmax steps fall on the same positions: step_aligned_context), so a request's tokens do
not depend on which requests share its steps, how its prompt was cut into chunks, or whose
cached blocks it reuses (tests/attention/test_chunk_invariance.py,
tests/engine/test_batch_invariance.py). Recomputing a preempted request's generated tokens as
a prompt is the exception: those go through the prefill kernel the second time.

A sliding window and logit soft-capping go into both kernels: each reads keys from the
window's first block on (a decode costs O(window), whatever the sequence's length), and a
chunk's K/V are gathered from its first query's window on.

Where a build prefers torch's SDPA to its prefill kernel (none does today), or the prefill
kernel does not take the model's head size (kernels.prefill_takes), the split is by the K/V
rows a chunk's query tokens read in all (under a sliding window, only the window's keys count)
against a threshold measured per ISA, thresholds.prefill_split: small chunks to the decode
kernel, larger ones to SDPA. Layers with a window take their own split, built by the first of
them.

Whatever a kernel refuses (another dtype, a shape it does not hold, no C compiler to build the
kernels with) takes the torch reference's path instead, so this backend answers wherever the
torch one does, and the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbgen.attention import torch_backend
from cbgen.attention.base import AttentionBackend, AttentionMetadata
from cbgen.attention.torch_backend import AttentionPlan, PrefillChunk
from cbgen.cpu import kernels, thresholds


@dataclass
class NativePlan:
    """Work for the C decode kernel: every decode, and every token of the prefill chunks that
    read at most thresholds.prefill_split()[0] K/V rows. Tokens are in flat-batch order, so when
    all are covered, row i is token i."""

    tokens: torch.Tensor  # [N] token indices in the flat batch
    blocks: torch.Tensor  # [N, nb] int32 block table row of each token's sequence
    seq_lens: torch.Tensor  # [N] int32 keys each token sees
    prefills: list[PrefillChunk]
    """The prefill chunks left to the prefill kernel."""


@dataclass
class CpuPlan:
    """A step's plan for this backend: the kernels' share and the reference's."""

    reference: AttentionPlan
    """The torch reference's plan: what the kernels refuse goes this way."""
    native: NativePlan
    """The kernels' share without a sliding window, prompt chunks to the prefill kernel."""
    block_table: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    prompts: list[bool]
    """Whether row i's new tokens start inside its prompt."""
    variants: dict[tuple[int | None, bool], NativePlan] = field(default_factory=dict)
    """The kernels' share per sliding window and prompt_kernel, built by the first layer that
    asks."""

    def native_for(self, window: int | None, prompt_kernel: bool = True) -> NativePlan:
        """The kernels' share under a sliding window (None: the plain one); prompt_kernel:
        whether the prefill kernel takes this model's heads (kernels.prefill_takes). Where it
        takes every prompt token, a window changes no token's kernel: the plain plan serves."""
        if prompt_kernel and (window is None or thresholds.prefill_split()[1]):
            return self.native
        nat = self.variants.get((window, prompt_kernel))
        if nat is None:
            nat = self.variants[(window, prompt_kernel)] = _native_plan(
                self.reference,
                self.block_table,
                self.query_start_loc,
                self.seq_lens,
                self.prompts,
                prompt_kernel,
                window,
            )
        return nat


def plan_attention(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor | None = None,
    prompts: np.ndarray | None = None,
) -> CpuPlan:
    """The reference's plan, and which tokens the decode kernel takes (see NativePlan).
    prompts: [B] whether row i's new tokens start inside its prompt (AttentionMetadata.prompts;
    None: only chunks of 2+ tokens are prompt chunks)."""
    reference = torch_backend.plan_attention(
        block_table, query_start_loc, seq_lens, block_size, slot_mapping
    )
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    flags = [False] * len(lens) if prompts is None else prompts.tolist()
    native = _native_plan(reference, block_table, qsl, lens, flags, True, None)
    return CpuPlan(reference, native, block_table, qsl, lens, flags)


def rows_read(query_len: int, seq_len: int, window: int | None) -> int:
    """The K/V rows a chunk's query_len tokens, the last at key seq_len - 1, read in all: query j
    sees seq_len - query_len + j + 1 keys, at most `window` of them."""
    first = seq_len - query_len + 1  # the keys of the chunk's first query
    capped = 0 if window is None else min(query_len, max(0, seq_len - max(first, window) + 1))
    full = query_len - capped  # queries that see all their keys: first .. first + full - 1
    return capped * (window or 0) + full * (2 * first + full - 1) // 2


def _native_plan(
    reference: AttentionPlan,
    block_table: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    prompts: list[bool],
    prompt_kernel: bool,
    window: int | None,
) -> NativePlan:
    """Every decode; with the prefill kernel (thresholds.prefill_split()[1], and prompt_kernel:
    it takes the model's heads), no prompt token, however small its chunk; without it, the
    tokens of the prefill chunks that read at most thresholds.prefill_split()[0] K/V rows under
    the window."""
    left = {p[0]: p for p in reference.prefills}
    most_rows, preferred = thresholds.prefill_split()
    prompt_kernel = prompt_kernel and preferred
    block_size = reference.block_size
    tokens, rows, keys = [], [], []
    max_len = 0
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        qlen = end - start
        if qlen == 0:
            continue
        if prompt_kernel and (qlen > 1 or prompts[i]):
            if qlen == 1:  # a one-token prompt chunk: the prompt kernel's too
                nb = -(-seq_len // block_size)
                left[start] = (start, end, seq_len, block_table[i, :nb])
            continue
        if qlen > 1:
            if rows_read(qlen, seq_len, window) > most_rows:
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


KEY_STEP = 64
"""Keys per softmax step of the prompt kernels (KC in prefill_attention.c, on every ISA)."""


def step_aligned_context(
    kv_cache: torch.Tensor, chunk: PrefillChunk, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt chunk's keys and values from its first query's window's block on
    (torch_backend.gather_context), behind as many zero rows as put the first of them at a
    whole number of KEY_STEP keys: each query's softmax steps then cover the same positions
    whichever chunk it is in. The zero rows sit before every query's window, so they are
    masked; the blocks there are never read (they may belong to another sequence by now)."""
    start, end, seq_len, _ = chunk
    block_size = kv_cache.shape[2]
    first = torch_backend.first_window_block(seq_len, end - start, window, block_size)
    keys, values = torch_backend.gather_context(kv_cache, chunk, first)
    pad = first * block_size % KEY_STEP
    if pad:
        zeros = keys.new_zeros(pad, *keys.shape[1:])
        keys, values = torch.cat([zeros, keys]), torch.cat([zeros, values])
    return keys, values


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: CpuPlan,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    bf16_dot_products: bool = False,
) -> torch.Tensor:
    """Attention of query [T, H, D] over the paged cache: the kernels in float32 (prompt chunks
    over a bf16 cache in bf16 dot products with bf16_dot_products), the torch reference for
    the rest (see the module docstring)."""
    window, cap = sliding_window, logit_softcap
    if query.dtype != torch.float32 or kv_cache.dtype not in (torch.float32, torch.bfloat16):
        return torch_backend.attend(query, kv_cache, plan.reference, scale, window, cap)
    nat = plan.native_for(window, kernels.prefill_takes(query.shape[2]))
    out: torch.Tensor | None = None
    prefills = nat.prefills
    if nat.tokens.numel():
        all_native = nat.tokens.shape[0] == query.shape[0]  # then row i is token i
        o = kernels.paged_decode_f32(
            query if all_native else query[nat.tokens],
            kv_cache,
            nat.blocks,
            nat.seq_lens,
            scale,
            window,
            cap,
        )
        if o is not None and all_native:
            return o
        out = torch.empty_like(query)
        if o is not None:
            out[nat.tokens] = o
        else:  # the kernel refused: decodes and small chunks go the reference's way
            torch_backend.attend_decodes(query, kv_cache, plan.reference, scale, out, window, cap)
            prefills = plan.reference.prefills
    if out is None:
        out = torch.empty_like(query)
    prefill_kernel = thresholds.prefill_split()[1]
    for chunk in prefills:
        start, end = chunk[0], chunk[1]
        keys, values = step_aligned_context(kv_cache, chunk, window)
        o = None
        if prefill_kernel and bf16_dot_products and keys.dtype == torch.bfloat16:
            o = kernels.prefill_attention_bf16(query[start:end], keys, values, scale, window, cap)
        if o is None:
            keys, values = keys.float(), values.float()  # a bf16 cache's rows, widened (exactly)
            if prefill_kernel:
                o = kernels.prefill_attention_f32(
                    query[start:end], keys, values, scale, window, cap
                )
        out[start:end] = (
            o
            if o is not None
            else torch_backend.attend_chunk(query[start:end], keys, values, scale, window, cap)
        )
    return out


class CpuAttentionBackend(AttentionBackend):
    """The C kernels on the CPU, the torch reference wherever they cannot run."""

    name = "cpu"

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.block_table.device.type != "cpu":
            raise ValueError(
                f"attention_backend: cpu runs on the CPU, not {meta.block_table.device}"
            )
        meta.state = plan_attention(
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_size,
            meta.slot_mapping,
            meta.prompts,
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
        plan: CpuPlan = meta.state
        if not kernels.write_kv_f32(key, value, kv_cache, meta.slot_mapping):
            torch_backend.write_kv_cache(
                key, value, kv_cache, meta.slot_mapping, plan.reference.may_have_negative
            )
        return attend(
            query, kv_cache, plan, scale, sliding_window, logit_softcap, self.bf16_dot_products
        )
