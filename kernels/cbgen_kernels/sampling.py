"""Per-row uniform numbers for the sampler, drawn on the device by a counter-based generator.

    seeds     [B] int64   each row's request seed
    counters  [B] int64   how many numbers that request has drawn so far
    out       [B] float32 u in [0, 1)

Row i's number is Philox(key = seeds[i], counter = counters[i]) (tl.rand, 10 rounds) and depends
on nothing else: not on the row's position in the batch, not on the other rows. A request that
draws one number per step with its counter advanced by one each time replays the same stream
alone, in any batch, and after a recompute. Counters are taken modulo 2^32 (Philox's 32-bit
counter word); the seed is the whole 64-bit key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128
"""Rows per program."""


# n (the random rows of a step) changes every step: exempt from specialisation (n == 1, n % 16
# == 0), or the sampler would compile new variants mid-run.
@triton.jit(do_not_specialize=("n",))
def _uniform_kernel(seed_ptr, counter_ptr, out_ptr, n, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n
    seed = tl.load(seed_ptr + rows, mask=mask, other=0)
    counter = (tl.load(counter_ptr + rows, mask=mask, other=0) & 0xFFFFFFFF).to(tl.uint32)
    tl.store(out_ptr + rows, tl.rand(seed, counter), mask=mask)


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in [0, 1) per row, float32, on the tensors' device (see the module
    docstring). seeds and counters: [B] int64 on the same device."""
    if seeds.shape != counters.shape or seeds.dim() != 1:
        raise ValueError(
            f"uniform_draws: seeds {tuple(seeds.shape)} and counters {tuple(counters.shape)} "
            "must be the same 1-D shape"
        )
    if seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(
            f"uniform_draws: seeds and counters must be int64, not {seeds.dtype} / {counters.dtype}"
        )
    n = seeds.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=seeds.device)
    if n:
        _uniform_kernel[(triton.cdiv(n, BLOCK),)](
            seeds.contiguous(), counters.contiguous(), out, n, BLOCK=BLOCK
        )
    return out
