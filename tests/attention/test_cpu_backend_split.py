"""The cpu attention backend's split of a step's tokens between the C decode and prefill kernels:
every prompt token to the prefill kernel; where a build prefers SDPA to it, by the K/V rows a
chunk reads, and under a sliding window only the window's keys count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbgen.attention import cpu_backend, torch_backend
from cbgen.cpu import build, kernels, thresholds

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())


def test_rows_read_counts_each_querys_visible_keys() -> None:
    for query_len, seq_len, window in [
        (1, 1, None),
        (5, 5, None),
        (9, 70, None),
        (9, 70, 4),
        (9, 70, 65),  # the window cuts into the chunk's first queries only
        (30, 40, 20),  # some queries see fewer keys than the window, the rest are capped
        (30, 40, 40),
        (30, 40, 400),
        (1, 100, 1),
    ]:
        first = seq_len - query_len + 1
        want = sum(
            min(k, window or k) for k in range(first, seq_len + 1)
        )  # query j sees first + j keys
        assert cpu_backend.rows_read(query_len, seq_len, window) == want, (
            query_len,
            seq_len,
            window,
        )


def _batch() -> tuple[torch.Tensor, ...]:
    """A decode over 40 keys, a 100-token chunk after 200 cached tokens, and a one-token chunk
    at key 7 (a decode or the last token of a prompt, as the step says)."""
    torch.manual_seed(3)
    bs, hkv, group, d, num_blocks = 16, 2, 3, 64, 64
    kv = torch.randn(2, num_blocks, bs, hkv, d)
    shape = [(1, 40), (100, 300), (1, 7)]  # (query_len, seq_len)
    qsl = torch.tensor([0] + [q for q, _ in shape]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in shape], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[: 3 * 19].view(3, 19).int()
    q = torch.randn(int(qsl[-1]), hkv * group, d)
    return q, kv, qsl, seq_lens, block_table


def _count(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    calls: list[int] = []
    inner = getattr(module, name)

    def counted(query: torch.Tensor, *args: object) -> object:
        calls.append(query.shape[0])
        return inner(query, *args)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_every_prompt_chunk_takes_the_prefill_kernel_however_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the prefill kernel, every prompt token takes it, a one-token chunk the step marks
    as a prompt's included, under any window: a token's bits then never depend on how its
    prompt was cut into chunks. Decodes take the decode kernel. Both match the reference."""
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (4096, True))
    calls = _count(monkeypatch, kernels, "prefill_attention_f32")
    q, kv, qsl, seq_lens, block_table = _batch()
    prompts = np.array([False, False, True])
    plan = cpu_backend.plan_attention(block_table, qsl, seq_lens, 16, None, prompts)
    reference = torch_backend.plan_attention(block_table, qsl, seq_lens, 16)
    built: list[int | None] = []  # the windows a kernel plan was built for after the step's
    inner_plan = cpu_backend._native_plan
    monkeypatch.setattr(
        cpu_backend, "_native_plan", lambda *args: built.append(args[-1]) or inner_plan(*args)
    )
    for window in (None, 16, 250, 16, 250):  # layers asking again take the step's plans
        nat = plan.native_for(window)
        assert nat.tokens.tolist() == [0] and len(nat.prefills) == 2
        got = cpu_backend.attend(q, kv, plan, 0.125, window)
        want = torch_backend.attend(q, kv, reference, 0.125, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert built == []  # a window changes no token's kernel: the step's one plan serves
    assert calls == [100, 1] * 5
    # unmarked, the one-token chunk is a decode
    plain = cpu_backend.plan_attention(block_table, qsl, seq_lens, 16)
    assert plain.native.tokens.tolist() == [0, 101] and len(plain.native.prefills) == 1


def test_without_the_prefill_kernel_a_windowed_layer_sends_a_long_chunk_to_the_decode_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a build prefers SDPA for large chunks: the 100-token chunk reads ~25k rows in all
    but only 1,600 under a window of 16, so with a 4,096-row split full layers send it to SDPA
    and windowed ones to the decode kernel, both matching the torch reference."""
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (4096, False))
    calls = _count(monkeypatch, torch_backend, "attend_chunk")
    q, kv, qsl, seq_lens, block_table = _batch()
    plan = cpu_backend.plan_attention(block_table, qsl, seq_lens, 16)
    reference = torch_backend.plan_attention(block_table, qsl, seq_lens, 16)
    assert len(plan.native_for(None).prefills) == 1
    assert plan.native_for(16).prefills == [] and plan.native_for(16).tokens.shape[0] == 102
    assert plan.native_for(16) is plan.native_for(16)  # built once a step, however many layers
    for window in (None, 16, 250):
        got = cpu_backend.attend(q, kv, plan, 0.125, window)
        calls_before = len(calls)
        want = torch_backend.attend(q, kv, reference, 0.125, window)
        del calls[calls_before:]  # the reference's own
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the full layer and the 250-key window (~24k rows) take SDPA, 16 does not
    assert calls == [100, 100]
