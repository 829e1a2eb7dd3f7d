"""The cpu attention backend's split of prompt chunks between the C decode and prefill kernels:
by the K/V rows a chunk reads, and under a sliding window only the window's keys count."""

from __future__ import annotations

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


def test_a_windowed_layer_sends_a_long_chunk_to_the_decode_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 100-token chunk after 200 cached tokens reads ~25k rows in all but only 1,600 under a
    window of 16: with a 4,096-row split, full layers send it to the prefill kernel and
    windowed ones to the decode kernel, both matching the torch reference."""
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (4096, True))
    prefill_calls: list[int] = []
    inner = kernels.prefill_attention_f32

    def prefill(query: torch.Tensor, *args: object) -> torch.Tensor | None:
        prefill_calls.append(query.shape[0])
        return inner(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "prefill_attention_f32", prefill)
    torch.manual_seed(3)
    bs, hkv, group, d, num_blocks = 16, 2, 3, 64, 64
    kv = torch.randn(2, num_blocks, bs, hkv, d)
    shape = [(1, 40), (100, 300), (1, 7)]  # (query_len, seq_len): decode, chunk, decode
    qsl = torch.tensor([0] + [q for q, _ in shape]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in shape], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[: 3 * 19].view(3, 19).int()
    q = torch.randn(int(qsl[-1]), hkv * group, d)
    plan = cpu_backend.plan_attention(block_table, qsl, seq_lens, bs)
    reference = torch_backend.plan_attention(block_table, qsl, seq_lens, bs)
    built: list[int | None] = []  # the windows a kernel plan was built for
    inner_plan = cpu_backend._native_plan
    monkeypatch.setattr(
        cpu_backend, "_native_plan", lambda *args: built.append(args[-1]) or inner_plan(*args)
    )
    assert len(plan.native_for(None).prefills) == 1
    assert plan.native_for(16).prefills == [] and plan.native_for(16).tokens.shape[0] == 102
    for window in (None, 16, 250, 16, 250):  # layers asking again take the step's plans
        got = cpu_backend.attend(q, kv, plan, 0.125, window)
        want = torch_backend.attend(q, kv, reference, 0.125, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert built == [16, 250]  # one plan per window a step, however many layers ask
    # the full layer and the 250-key window (~24k rows) take the prefill kernel, 16 does not
    assert prefill_calls == [100, 100, 100]
