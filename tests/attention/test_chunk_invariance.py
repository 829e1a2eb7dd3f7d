"""A prompt token's attention does not depend on how its prompt was cut into chunks: the cpu
backend gives each query row the same bits whether its prompt came in one chunk, in several
(as the token budget or a cached prefix cuts it), or one token at a time, under a sliding
window and soft-capping too, over a float32 cache and a bf16 one. Together with matmuls that
give each row the same bits whatever the batch, that makes a request's tokens independent of
the other requests in its steps (tests/engine/test_batch_invariance.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbgen.attention import cpu_backend
from cbgen.cpu import build

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())

CUTS = [
    [150],  # the whole prompt at once
    [64, 86],  # at a softmax step's boundary
    [37, 1, 100, 12],  # mid-step, a one-token chunk among them
    [16, 16, 16, 102],  # block by block, as a cached prefix leaves it
    [1] * 20 + [130],  # token by token first
]


def _attend_in_chunks(
    q: torch.Tensor,
    kv: torch.Tensor,
    blocks: torch.Tensor,
    cuts: list[int],
    window: int | None,
    softcap: float | None,
    bf16_dots: bool,
) -> torch.Tensor:
    """The prompt's rows attended chunk by chunk, each chunk a step of its own beside a decode
    of another sequence (the step marks the chunk as a prompt's)."""
    out = []
    start = 0
    bs = kv.shape[2]
    for n in cuts:
        end = start + n
        qsl = torch.tensor([0, n, n + 1], dtype=torch.int32)
        seq_lens = torch.tensor([end, 33], dtype=torch.int32)
        table = torch.stack([blocks, blocks.flip(0)]).int()
        step_q = torch.cat([q[start:end], q[:1]])
        plan = cpu_backend.plan_attention(table, qsl, seq_lens, bs, None, np.array([True, False]))
        o = cpu_backend.attend(step_q, kv, plan, 0.125, window, softcap, bf16_dots)
        out.append(o[:n])
        start = end
    return torch.cat(out)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("window", "softcap", "cache"),
    [
        (None, None, torch.float32),
        (40, None, torch.float32),  # windows that start mid-block and mid-step
        (100, 30.0, torch.float32),
        (None, None, torch.bfloat16),
        (40, None, torch.bfloat16),
    ],
)
def test_a_prompt_rows_bits_do_not_depend_on_its_chunks(
    window: int | None, softcap: float | None, cache: torch.dtype
) -> None:
    torch.manual_seed(5)
    bs, hkv, group, d = 16, 3, 3, 64
    kv = torch.randn(2, 12, bs, hkv, d).to(cache)
    blocks = torch.randperm(12)[:10]
    q = torch.randn(150, hkv * group, d)
    for bf16_dots in (False, True) if cache == torch.bfloat16 else (False,):
        first = _attend_in_chunks(q, kv, blocks, CUTS[0], window, softcap, bf16_dots)
        assert torch.isfinite(first).all()
        for cuts in CUTS[1:]:
            got = _attend_in_chunks(q, kv, blocks, cuts, window, softcap, bf16_dots)
            differ = (got != first).any(dim=(1, 2)).nonzero().flatten().tolist()
            assert not differ, (cuts, bf16_dots, differ[:10])
