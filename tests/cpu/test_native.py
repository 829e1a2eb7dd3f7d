"""The CPU C kernels (cbgen/cpu/csrc) against the torch formulations they replace, built
as -march=native gives and with AVX-512 switched off (what an AVX2-only CPU gets); the build
cache keyed by target, the status line, the fallback without kernels, the argument checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO
from helpers.reference import attention_float64

from cbgen.attention import cpu_backend, torch_backend
from cbgen.cpu import bf16, gemm, head_kernels, kernels, quant
from cbgen.cpu import build as cpu_build
from cbgen.cpu import thresholds as cpu_thresholds
from cbgen.cpu.arena import HUGE_PAGE, HugePageArena
from cbgen.cpu.features import ISA_SETTING, CpuInfo, cpu_info
from cbgen.models.base import RMSNorm
from cbgen.models.ops import TORCH_OPS
from cbgen.runtime.cpu_linear import PackedF32Linear
from cbgen.runtime.cpu_ops import CPU_OPS, CpuOps

pytestmark = pytest.mark.skipif(cpu_build.load_library() is None, reason=cpu_build.native_status())


@pytest.mark.usefixtures("each_build")
def test_add_rmsnorm_matches_residual_add_then_rmsnorm() -> None:
    torch.manual_seed(0)
    for t in (1, 7, 600):  # 600 x 576 crosses the threshold where the kernel goes parallel
        res, x = torch.randn(t, 576), torch.randn(t, 576)
        norm = RMSNorm(576, 1e-5)
        norm.weight.data.uniform_(0.5, 1.5)
        want_res = res + x
        want = norm(want_res)
        got = kernels.add_rmsnorm_(res, x, norm.weight.data, 1e-5)
        assert torch.equal(res, want_res)  # the residual stream is bit-identical
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        only = kernels.add_rmsnorm_(want_res.clone(), None, norm.weight.data, 1e-5)
        torch.testing.assert_close(only, want, rtol=2e-6, atol=2e-6)


@pytest.mark.usefixtures("each_build")
def test_head_rmsnorm_in_place_matches_the_norm_of_each_head() -> None:
    """q/k norms in the rows of a QKV projection: only the first `heads` heads of each row
    change, each to RMSNorm(head) * weight; strided rows; 2,000 rows go parallel."""
    torch.manual_seed(1)
    for t, heads, d in ((1, 4, 128), (5, 3, 64), (2000, 16, 64)):
        qkv = torch.randn(t, (heads + 2) * d + 8) * 3
        norm = RMSNorm(d, 1e-6)
        norm.weight.data.uniform_(0.5, 1.5)
        want = qkv.clone()
        want[:, : heads * d] = norm(qkv[:, : heads * d].reshape(t, heads, d)).reshape(t, -1)
        view = qkv[:, : (heads + 1) * d]  # strided rows: the row stride is the full width
        kernels.rmsnorm_heads_(view, heads, d, norm.weight.data, 1e-6)
        assert torch.equal(qkv[:, heads * d :], want[:, heads * d :])
        torch.testing.assert_close(qkv, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="rows of 3 heads x 64"):
        kernels.rmsnorm_heads_(torch.randn(2, 100), 3, 64, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        kernels.rmsnorm_heads_(torch.randn(2, 192), 3, 64, torch.ones(32), 1e-6)


@pytest.mark.usefixtures("each_build")
def test_rope_in_place_is_bit_identical_to_the_reference_formula() -> None:
    torch.manual_seed(2)
    t, heads, d = 9, 5, 64
    qkv = torch.randn(t, heads * d + 3 * d)  # extra columns after the rotated heads stay put
    positions = torch.tensor([0, 1, 2, 17, 100, 3, 4, 511, 9])
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    )
    cos, sin = freqs.cos(), freqs.sin()
    want = qkv.clone()  # the reference op, in place on a strided row like the kernel
    TORCH_OPS.rope_(want, heads, d, TORCH_OPS.rope_tables(cos, sin, positions, torch.float32))
    tail = qkv[:, heads * d :].clone()
    CPU_OPS.rope_(qkv, heads, d, CPU_OPS.rope_tables(cos, sin, positions, torch.float32))
    assert torch.equal(qkv, want)
    assert torch.equal(qkv[:, heads * d :], tail)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("group", "block_size", "head_dim", "hkv", "batch"),
    [
        (1, 16, 64, 2, 4),
        (3, 4, 64, 2, 4),
        (8, 32, 64, 2, 4),
        (4, 16, 128, 2, 4),  # the D = 128 register path
        (2, 16, 80, 3, 4),  # a head size with no special path
        (3, 16, 64, 4, 1),  # one sequence: the KV heads are split across threads
        (3, 16, 64, 3, 24),  # many sequences, one work item each
    ],
)
def test_paged_decode_matches_the_torch_reference(
    group: int, block_size: int, head_dim: int, hkv: int, batch: int
) -> None:
    torch.manual_seed(3)
    num_blocks = 8 * batch + 8
    kv = torch.randn(2, num_blocks, block_size, hkv, head_dim)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 8 * block_size, 2 * block_size + 3]
    seq_lens = torch.tensor([lens[i % len(lens)] for i in range(batch)], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[: 8 * batch].view(batch, 8).int()
    q = torch.randn(batch, hkv * group, head_dim)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    want = torch_backend.paged_attention(q, kv, block_table, qsl, seq_lens, 0.125)
    got = kernels.paged_decode_f32(q, kv, block_table, seq_lens, 0.125)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the query as the model hands it over: a slice of each fused QKV row, read in place
    qkv = torch.randn(batch, (hkv * group + 2 * hkv) * head_dim)
    qkv[:, : hkv * group * head_dim] = q.reshape(batch, -1)
    view = qkv[:, : hkv * group * head_dim].view(batch, hkv * group, head_dim)
    assert view.is_contiguous() == (batch == 1)
    in_place = kernels.paged_decode_f32(view, kv, block_table, seq_lens, 0.125)
    assert in_place is not None and torch.equal(in_place, got)


def test_paged_decode_refuses_shapes_it_cannot_hold_and_attend_falls_back() -> None:
    """More query heads per KV head than the kernel's group limit: the kernel says no (None)
    instead of writing nothing, and the cpu backend answers through the torch path."""
    torch.manual_seed(8)
    batch, hkv, group, d, bs = 3, 1, 17, 64, 16
    kv = torch.randn(2, 12, bs, hkv, d)
    seq_lens = torch.tensor([5, 16, 40], dtype=torch.int32)
    block_table = torch.randperm(12)[:9].view(batch, 3).int()
    q = torch.randn(batch, hkv * group, d)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    assert kernels.paged_decode_f32(q, kv, block_table, seq_lens, 0.125) is None
    plan = cpu_backend.plan_attention(block_table, qsl, seq_lens, bs)
    got = cpu_backend.attend(q, kv, plan, 0.125)
    want = torch_backend.paged_attention(q, kv, block_table, qsl, seq_lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("each_build")
def test_softmax_exponentials_are_within_three_ulp_of_expf() -> None:
    """The decode kernel's polynomial exp against torch.exp, from the maximum (exp 0 = 1)
    down past float32's underflow, at lengths that end mid-vector."""
    torch.manual_seed(7)
    for n in (1, 15, 16, 17, 1000):
        m = 3.5
        x = (
            m
            - torch.cat(
                [
                    torch.tensor([0.0, 1e-30, 0.3466, 0.3467, 87.0, 87.5, 104.0, 200.0]),
                    110.0 * torch.rand(n),
                ]
            )[:n]
        )
        x = x.contiguous()
        want = torch.exp((x - m).double())  # the float32 difference, like expf(s - m)
        got = x.clone()
        total = kernels.exp_sub_sum_(got, m)
        # 3 ulp; results at the bottom of float32's normal range may flush to zero
        ulp = torch.finfo(torch.float32).eps * want
        assert (
            (got.double() - want).abs() <= (3 * ulp).clamp(min=2 * torch.finfo(torch.float32).tiny)
        ).all(), n
        assert total == pytest.approx(float(want.sum()), rel=1e-6)
    # a NaN score (a broken model) stays visible instead of silently weighing nothing
    x = torch.tensor([0.0, float("nan"), -1.0, float("-inf")])
    total = kernels.exp_sub_sum_(x, 0.0)
    assert x[0] == 1.0 and x[1].isnan() and x[3] == 0.0 and total != total


@pytest.mark.usefixtures("each_build")
def test_silu_mul_matches_silu_times_up_to_a_few_ulp() -> None:
    """One pass over gate-up [T, 2I] against torch's silu(gate) * up, computed in float64 from
    the same float32 inputs: both sides of 0, |g| up to 100 (exp underflows), widths that end
    mid-vector; torch's infinities and NaN."""
    torch.manual_seed(3)
    for t, i in ((1, 1), (3, 15), (2, 16), (5, 17), (4, 1536)):
        g = torch.cat(
            [
                torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, -100.0]),
                8 * torch.randn(t * i),
            ]
        )
        gu = torch.stack([g[: t * i].view(t, i), torch.randn(t, i)], dim=1).reshape(t, 2 * i)
        got = kernels.silu_mul(gu)
        gd, ud = gu[:, :i].double(), gu[:, i:].double()
        want = gd / (1 + torch.exp(-gd)) * ud
        assert got.shape == (t, i)
        # a few ulp of each result (the exp's 3, the division's and product's rounding); below
        # g = -87.33 the exp flushes to zero, so results under ~1e-36 in size may be 0
        tol = 6 * torch.finfo(torch.float32).eps * want.abs() + 1e-35
        assert ((got.double() - want).abs() <= tol).all(), (t, i)
    special = torch.tensor(
        [[float("inf"), float("-inf"), float("nan"), 1.0, 2.0, 2.0, 2.0, float("inf")]]
    )
    got, want = kernels.silu_mul(special), torch.nn.functional.silu(special[:, :4]) * special[:, 4:]
    assert got[0, 0] == want[0, 0] == float("inf")
    assert got[0, 1].isnan() and want[0, 1].isnan() and got[0, 2].isnan() and want[0, 2].isnan()
    assert got[0, 3] == pytest.approx(float(want[0, 3]), rel=1e-6)


@pytest.mark.usefixtures("each_build")
def test_gelu_tanh_mul_matches_the_tanh_gelu_times_up() -> None:
    """GeGLU in one pass: against the same function in float64 (as a sigmoid, which keeps its
    precision where the tanh form cancels) from the float32 inputs, to a few ulp plus what
    float32 inputs to the cubic cost in the far negative tail; against torch's
    gelu(approximate="tanh") * up where torch does not cancel; infinities and NaN as torch."""
    torch.manual_seed(5)
    for t, i in ((1, 1), (3, 15), (5, 17), (4, 1536)):
        g = torch.cat(
            [torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, -12.0]), 4 * torch.randn(t * i)]
        )
        gu = torch.stack([g[: t * i].view(t, i), torch.randn(t, i)], dim=1).reshape(t, 2 * i)
        got = kernels.gelu_tanh_mul(gu)
        gd, ud = gu[:, :i].double(), gu[:, i:].double()
        z = (8 / torch.pi) ** 0.5 * (gd + 0.044715 * gd**3)
        want = gd / (1 + torch.exp(-z)) * ud
        tol = (8 + 4 * z.abs()) * torch.finfo(torch.float32).eps * want.abs() + 1e-35
        assert ((got.double() - want).abs() <= tol).all(), (t, i)
        near = gu[:, :i].abs() <= 3
        reference = torch.nn.functional.gelu(gu[:, :i], approximate="tanh") * gu[:, i:]
        torch.testing.assert_close(got[near], reference[near], rtol=1e-5, atol=1e-6)
    special = torch.tensor([[float("inf"), float("-inf"), float("nan"), 2.0, 2.0, 2.0]])
    got = kernels.gelu_tanh_mul(special)
    assert got[0, 0] == float("inf") and got[0, 1].isnan() and got[0, 2].isnan()
    torch.testing.assert_close(CPU_OPS.gelu_tanh_mul(special), got, rtol=0, atol=0, equal_nan=True)


def _inverse_cdf_float64(
    logits: torch.Tensor, temperature: float, u: float
) -> tuple[int, torch.Tensor, float]:
    """The sampling rule in float64 from the float32 quotient logits / T: (pick, cdf, target)."""
    x = (logits / temperature).double()
    cdf = torch.exp(x - x.max()).cumsum(0)
    target = float(u) * float(cdf[-1])
    return (
        int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)),
        cdf,
        target,
    )


@pytest.mark.usefixtures("each_build")
def test_sample_is_the_inverse_cdf_of_the_tempered_softmax() -> None:
    """Rows of 17 (a partial vector), 1000 and 49152 tokens (192 chunks), temperatures on both
    sides of 1, every 7th token masked to -inf, draws at 0 and just under 1, rows read
    through a stride wider than the vocabulary: each pick is the float64 reference's, or a
    neighbour across a boundary the float32 weights cannot resolve; the logits are left as
    they were."""
    torch.manual_seed(5)
    for v in (17, 1000, 49152):
        b = 24
        wide = 3 * torch.randn(b, v + 5)
        wide[:, :v:7] = float("-inf")
        logits = wide[:, :v]
        before = logits.clone()
        temp = torch.rand(b) * 2 + 0.2
        temp[:6] = 1.0
        u = torch.rand(b)
        u[0], u[1] = 0.0, float(torch.tensor(1.0).nextafter(torch.tensor(0.0)))
        got = kernels.sample(logits, temp, u)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(logits, before)
        assert not logits.gather(1, got[:, None]).isinf().any()  # never a masked token
        for r in range(b):
            want, cdf, target = _inverse_cdf_float64(logits[r], float(temp[r]), float(u[r]))
            if int(got[r]) != want:
                # only where the target sits within float32 rounding of the boundary between them
                edge = float(cdf[min(int(got[r]), want)])
                assert abs(edge - target) <= 1e-5 * float(cdf[-1]), (v, r, int(got[r]), want)
        assert int(got[1]) == max(
            i for i in range(v) if i % 7
        )  # u just under 1: the last live token


@pytest.mark.usefixtures("each_build")
def test_sample_covers_every_live_token_and_refuses_nan_and_inf() -> None:
    logits = torch.full((1, 40), float("-inf"))
    live = [3, 17, 18, 39]
    logits[0, live] = torch.tensor([0.0, 1.0, -2.0, 0.5])
    p = torch.softmax(logits[0], 0)
    # u swept over [0, 1): each live token is picked over a share of u equal to its probability
    us = (torch.arange(2000, dtype=torch.float32) + 0.5) / 2000
    picks = [int(kernels.sample(logits, torch.ones(1), us[i : i + 1])[0]) for i in range(2000)]
    for t in live:
        assert abs(picks.count(t) / 2000 - float(p[t])) <= 1 / 2000 + 1e-6
    assert set(picks) == set(live)
    # a column-major view samples as its contiguous copy does
    block = torch.randn(5, 40)
    u5 = torch.rand(5)
    assert torch.equal(
        kernels.sample(block.t().contiguous().t(), torch.ones(5), u5),
        kernels.sample(block, torch.ones(5), u5),
    )
    for bad in (float("nan"), float("inf")):
        rows = torch.zeros(3, 40)
        rows[1, 5] = bad
        assert kernels.sample(rows, torch.ones(3), torch.full((3,), 0.5)) is None
    assert kernels.sample(torch.full((1, 8), float("-inf")), torch.ones(1), torch.zeros(1)) is None


@pytest.mark.usefixtures("each_build")
def test_paged_decode_softmax_over_a_wide_range_of_scores() -> None:
    """Scores from about -400 to 400: the kernel's exponentials underflow to zero far below
    the maximum and stay accurate near it; 40 sequences take every thread through several
    items (each prefetches the next one's blocks)."""
    torch.manual_seed(6)
    batch, hkv, group, d, bs = 40, 3, 3, 64, 16
    kv = torch.randn(2, 8 * batch, bs, hkv, d)
    seq_lens = torch.randint(1, 8 * bs, (batch,), dtype=torch.int32)
    block_table = torch.randperm(8 * batch).view(batch, 8).int()
    q = 60.0 * torch.randn(batch, hkv * group, d)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    exact = torch_backend.paged_attention(
        q.double(), kv.double(), block_table, qsl, seq_lens, 0.125
    )
    torch_error = (
        (torch_backend.paged_attention(q, kv, block_table, qsl, seq_lens, 0.125) - exact)
        .abs()
        .max()
    )
    got = kernels.paged_decode_f32(q, kv, block_table, seq_lens, 0.125)
    assert got is not None
    # scores this large amplify float32 rounding: as close to the float64 result as torch is
    assert (got - exact).abs().max() <= 2 * torch_error + 1e-6


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_mixed_batch_through_the_kernel_matches_the_torch_path(
    prefill_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu backend's attention: decodes (the C decode kernel), small prefill chunks (with
    and without cached context) and large ones (with and without cached context) in one flat
    batch, against the torch reference (SDPA); the large chunks also against a float64 softmax
    written out. With the prefill kernel every chunk takes it; where a build prefers SDPA, the
    small chunks take the decode kernel, one query token at a time, and the large ones SDPA."""
    monkeypatch.setattr(cpu_thresholds, "prefill_split", lambda: (8192, prefill_kernel))
    calls = []
    inner = kernels.prefill_attention_f32
    monkeypatch.setattr(
        kernels, "prefill_attention_f32", lambda *a: calls.append(a[0].shape[0]) or inner(*a)
    )
    torch.manual_seed(4)
    bs, hkv, group, d, num_blocks = 16, 2, 3, 64, 96
    kv = torch.randn(2, num_blocks, bs, hkv, d)
    # (query_len, seq_len): decode, small first chunk, small chunk after context, big chunk
    # after context, big first chunk, decode
    shape = [(1, 40), (12, 12), (9, 70), (150, 230), (140, 140), (1, 3)]
    assert 140 * (140 - 70) > cpu_thresholds.prefill_split()[0] > 9 * (70 - 4.5)
    qsl = torch.tensor([0] + [q for q, _ in shape], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in shape], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[: 6 * 15].view(6, 15).int()
    q = torch.randn(int(qsl[-1]), hkv * group, d)
    plan = cpu_backend.plan_attention(block_table, qsl, seq_lens, bs)
    assert len(plan.native.prefills) == (4 if prefill_kernel else 2)
    assert plan.native.tokens.shape[0] == (2 if prefill_kernel else int(qsl[-1]) - 150 - 140)
    got = cpu_backend.attend(q, kv, plan, 0.125)
    want = torch_backend.attend(
        q, kv, torch_backend.plan_attention(block_table, qsl, seq_lens, bs), 0.125
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == ([12, 9, 150, 140] if prefill_kernel else [])
    for i in (3, 4):
        (qlen, seq_len), start = shape[i], int(qsl[i])
        keys = kv[:, block_table[i]].flatten(1, 2)[:, :seq_len]  # [2, L, Hkv, D]
        exact = attention_float64(q[start : start + qlen], keys[0], keys[1], 0.125)
        torch.testing.assert_close(got[start : start + qlen].double(), exact, rtol=1e-5, atol=1e-5)
    # every token through the decode kernel: the result comes straight back from it
    monkeypatch.setattr(cpu_thresholds, "prefill_split", lambda: (8192, False))
    small = cpu_backend.plan_attention(block_table[:3], qsl[:4], seq_lens[:3], bs)
    n = int(qsl[3])
    assert small.native.tokens.tolist() == list(range(n))
    got = cpu_backend.attend(q[:n], kv, small, 0.125)
    want = torch_backend.attend(
        q[:n], kv, torch_backend.plan_attention(block_table[:3], qsl[:4], seq_lens[:3], bs), 0.125
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("qlen", "ctx", "heads", "kv_heads", "d"),
    [
        (1, 0, 9, 3, 64),  # one row, one key
        (7, 0, 9, 3, 64),  # fewer rows than a work item
        (37, 16, 9, 3, 64),  # cached context, rows not a multiple of 8
        (33, 31, 4, 1, 64),  # keys cross a 32-key chunk mid-item
        (100, 0, 4, 4, 128),  # no GQA, D = 128
        (64, 200, 8, 2, 128),  # long context before a short chunk
        (300, 0, 9, 3, 64),
    ],
)
def test_prefill_attention_matches_a_float64_causal_softmax(
    qlen: int, ctx: int, heads: int, kv_heads: int, d: int
) -> None:
    torch.manual_seed(qlen + ctx)
    q = torch.randn(qlen, heads, d) * 2
    k, v = torch.randn(ctx + qlen, kv_heads, d), torch.randn(ctx + qlen, kv_heads, d)
    got = kernels.prefill_attention_f32(q, k, v, d**-0.5)
    assert got is not None
    torch.testing.assert_close(
        got.double(), attention_float64(q, k, v, d**-0.5), rtol=1e-5, atol=2e-6
    )
    # query rows inside a wider tensor (the fused qkv layout): same answer
    wide = torch.randn(qlen, heads * d + 2 * kv_heads * d)
    wide[:, : heads * d] = q.flatten(1)
    view = wide[:, : heads * d].view(qlen, heads, d)
    assert qlen == 1 or not view.is_contiguous()
    assert torch.equal(kernels.prefill_attention_f32(view, k, v, d**-0.5), got)


@pytest.mark.usefixtures("each_build")
def test_prefill_attention_keeps_nan_to_the_rows_that_see_it_and_refuses_other_head_sizes() -> None:
    torch.manual_seed(9)
    q, k, v = torch.randn(40, 6, 64), torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    k[30, 1, 5] = float("nan")  # key position 30, KV head 1: query rows from 20 on see it
    got = kernels.prefill_attention_f32(q, k, v, 0.125)
    assert got is not None
    assert (
        got[20:, 3:].isnan().all() and not got[:20].isnan().any() and not got[:, :3].isnan().any()
    )
    assert (
        kernels.prefill_attention_f32(
            torch.randn(4, 2, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32), 0.2
        )
        is None
    )


@pytest.mark.usefixtures("each_build")
def test_kv_write_matches_index_copy_from_strided_views() -> None:
    """K and V as views into one fused qkv row (row stride > Hkv * D), a negative slot skipped,
    a slot past the cache refused before anything is written."""
    torch.manual_seed(5)
    t, hkv, d, heads = 40, 3, 64, 9
    qkv = torch.randn(t, (heads + 2 * hkv) * d)
    k = qkv[:, heads * d : (heads + hkv) * d].view(t, hkv, d)
    v = qkv[:, (heads + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(6 * 16)[:t]
    slots[7] = -1
    want = torch.randn(2, 6, 16, hkv, d)
    got = want.clone()
    torch_backend.write_kv_cache(k, v, want, slots)
    assert kernels.write_kv_f32(k, v, got, slots)
    assert torch.equal(got, want)
    before = got.clone()
    slots[3] = 6 * 16
    with pytest.raises(IndexError, match="past the cache"):
        kernels.write_kv_f32(k, v, got, slots)
    assert torch.equal(got, before)
    # not its job: other dtypes and layouts go to the torch path
    assert not kernels.write_kv_f32(k.double(), v.double(), got.double(), slots)
    assert not kernels.write_kv_f32(k.transpose(1, 2).contiguous().transpose(1, 2), v, got, slots)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(("n", "k"), [(96, 40), (64, 577), (960, 576)])
def test_small_gemm_matches_matmul_and_a_row_never_depends_on_the_batch(n: int, k: int) -> None:
    torch.manual_seed(6)
    weight, bias = torch.randn(n, k), torch.randn(n)
    panels = gemm.pack_panels(weight)
    assert panels is not None
    x = torch.randn(130, k)
    # every register-tile height (up to 16 rows with AVX-512, 6 with AVX2), and splits into tiles
    for m in (*range(1, 18), 29, 41, 64, 130):
        got = gemm.small_gemm(x[:m], panels, None)
        torch.testing.assert_close(got, x[:m] @ weight.T, rtol=1e-5, atol=1e-4)
        with_bias = gemm.small_gemm(x[:m], panels, bias)
        torch.testing.assert_close(with_bias, x[:m] @ weight.T + bias, rtol=1e-5, atol=1e-4)
    alone = torch.cat([gemm.small_gemm(x[i : i + 1], panels, bias) for i in range(29)])
    assert torch.equal(gemm.small_gemm(x[:29], panels, bias), alone)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(("n", "k"), [(64, 40), (96, 577)])
def test_small_gemm_tall_batches_give_every_row_the_bits_it_gets_alone(n: int, k: int) -> None:
    """From 96 rows (AVX2) or 256 (AVX-512) on (the build's default), rows go through
    small_gemm in packed blocks:
    the same in-order sums, so a prompt chunk of any size gives each row the bits of a decode
    batch of one, blocks and tiles cut anywhere (a last tile of one row, of a full tile)."""
    torch.manual_seed(7)
    weight, bias = torch.randn(n, k), torch.randn(n)
    panels = gemm.pack_panels(weight)
    assert panels is not None
    x = torch.randn(530, k)
    alone = torch.cat([gemm.small_gemm(x[i : i + 1], panels, bias) for i in range(530)])
    for m in (95, 96, 97, 101, 255, 256, 257, 263, 530):
        got = gemm.small_gemm(x[:m], panels, bias)
        assert torch.equal(got, alone[:m]), m
    # the tuning pass may start the blocks at any decode size: the same bits there too
    for m in (1, 5, 6, 7, 16, 17, 64):
        assert torch.equal(gemm.small_gemm(x[:m], panels, bias, blocked_from=1), alone[:m]), m
    torch.testing.assert_close(alone, x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    # rows past the batch are never written: the output is exactly [M, N]
    assert gemm.small_gemm(x[:97], panels, None).shape == (97, n)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("activation", "separate"), [("silu", "silu_mul"), ("gelu_tanh", "gelu_tanh_mul")]
)
def test_the_gated_matmul_gives_the_bits_of_the_matmul_then_the_activation(
    activation: str, separate: str
) -> None:
    """The gate-up matmul with the activation applied to its tiles: the same bits as small_gemm
    and then the activation pass, for batches cut into row blocks anywhere (a last tile of one
    row, of a full one); fewer rows than the blocks start at are not its job (None)."""
    torch.manual_seed(12)
    inter, k = 64, 577
    weight = torch.randn(2 * inter, k) * 0.2
    panels = gemm.pack_panels(weight)
    assert panels is not None
    x = torch.randn(400, k)
    blocked = cpu_thresholds.build_small_gemm_blocked_rows()
    for m in (blocked, blocked + 1, blocked + 7, 400):
        if m > 400:
            continue
        got = gemm.small_gemm_gated(x[:m], panels, activation)
        want = getattr(kernels, separate)(gemm.small_gemm(x[:m], panels, None))
        assert got is not None and torch.equal(got, want), m
    assert gemm.small_gemm_gated(x[: blocked - 1], panels, activation) is None
    for m in (1, 5, 6, 7):
        got = gemm.small_gemm_gated(x[:m], panels, activation, blocked_from=1)
        want = getattr(kernels, separate)(gemm.small_gemm(x[:m], panels, None))
        assert got is not None and torch.equal(got, want), m
    with pytest.raises(ValueError, match="activation: expected one of"):
        gemm.small_gemm_gated(x, panels, "relu")


def test_small_gemm_needs_whole_panels() -> None:
    assert gemm.pack_panels(torch.randn(100, 64)) is None
    assert gemm.pack_panels(torch.randn(96, 64).double()) is None


def _thp_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled, or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def _thp_eligible(address: int) -> bool | None:
    """Whether the mapping holding address may get transparent huge pages (/proc/self/smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def test_huge_page_arena_hands_out_disjoint_aligned_buffers() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    # a chunk holds 524,288 floats: the fourth buffer starts a new chunk, the fifth needs one
    # larger than chunk_bytes, the sixth finds it full
    sizes = [5, 100_000, 300_000, 200_000, 1 << 20, 7]
    bufs = [arena.empty(n) for n in sizes]
    for i, (b, n) in enumerate(zip(bufs, sizes, strict=True)):
        assert b.shape == (n,) and b.dtype == torch.float32
        assert b.data_ptr() % 64 == 0
        b.fill_(float(i))
    for i, b in enumerate(bufs):
        assert torch.equal(b, torch.full_like(b, float(i)))  # nothing overwrote anything
    if arena.huge:
        for first_of_chunk in (0, 3, 4, 5):  # a chunk starts on a huge page
            assert bufs[first_of_chunk].data_ptr() % HUGE_PAGE == 0
        assert bufs[1].data_ptr() - bufs[0].data_ptr() == 64  # 5 floats, rounded to a cache line
        if _thp_mode() in ("always", "madvise"):
            assert all(_thp_eligible(b.data_ptr()) for b in bufs)
    # other element types from the same chunks, each on a cache line of its own
    small = [arena.empty(3, torch.uint8), arena.empty(5, torch.bfloat16), arena.empty(2)]
    assert [b.dtype for b in small] == [torch.uint8, torch.bfloat16, torch.float32]
    assert [b.shape for b in small] == [(3,), (5,), (2,)]
    assert all(b.data_ptr() % 64 == 0 for b in small)
    for i, b in enumerate(small):
        b.fill_(100 + i)
    assert [b.tolist() for b in small] == [[100] * 3, [101.0] * 5, [102.0] * 2]
    assert torch.equal(bufs[-1], torch.full_like(bufs[-1], 5.0))
    plain = HugePageArena()
    plain.huge = False  # no MADV_HUGEPAGE on this OS: ordinary tensors
    assert plain.empty(10).shape == (10,)
    assert plain.empty(10, torch.uint8).dtype == torch.uint8


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_packed_weights_live_in_memory_advised_for_huge_pages() -> None:
    # every packed form a decode step streams: float32 and bf16 panels, GGUF blocks (Q8_0)
    blocks = torch.randint(0, 256, (16, 2 * 34), dtype=torch.uint8)
    packed = [
        gemm.pack_panels(torch.randn(96, 64)),
        bf16.pack_panels_bf16(torch.randn(96, 64).to(torch.bfloat16)),
        quant.pack(8, blocks, 16, 64),  # ggml type 8: Q8_0
    ]
    for p in packed:
        assert p is not None
        assert _thp_eligible(p.data_ptr())
    plain = torch.empty(1 << 20)  # the control: torch's own allocation is not advised
    assert _thp_mode() == "always" or _thp_eligible(plain.data_ptr()) is False


def test_the_cpu_linear_method_takes_the_panels_for_small_batches_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer's packed method sends up to the runtime's threshold of rows to small_gemm (with
    the runtime's row blocks), more to oneDNN; the thresholds are the runtime's, not the
    process's: two methods with their own answer their own."""
    from cbgen.cpu.linear import onednn_packing_available
    from cbgen.models.base import Linear
    from cbgen.runtime.cpu_linear import CpuThresholds, PackedF32Linear

    torch.manual_seed(7)
    layer = Linear(64, 96, bias=True)
    most = cpu_thresholds.build_small_gemm_max_rows()
    assert most >= 64  # every decode batch of a default run
    thresholds = CpuThresholds(most, blocked_rows=5)
    onednn = onednn_packing_available()
    layer.method = PackedF32Linear.pack(layer.weight.data, onednn, True, thresholds)
    calls = []
    inner = gemm.small_gemm

    def counted(*a: Any) -> torch.Tensor:
        calls.append((a[0].shape[0], a[3]))
        return inner(*a)

    monkeypatch.setattr(gemm, "small_gemm", counted)
    for m in (1, most, most + 1):
        x = torch.randn(m, 64)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-4)
    assert calls == [(1, 5), (most, 5)]
    other = Linear(64, 96, bias=False)
    other.method = PackedF32Linear.pack(other.weight.data, onednn, True, CpuThresholds(0))
    calls.clear()
    other(torch.randn(1, 64))
    assert calls == []  # its runtime's threshold: oneDNN (or torch) for every row


def test_every_kernel_source_ships_as_package_data() -> None:
    """The loader compiles these files at run time: a wheel without them has no CPU kernels."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = REPO
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["cbgen.cpu"]
    pkg = root / "cbgen" / "cpu"
    needed = [*cpu_build._SRCS, *cpu_build._HEADERS]
    assert needed and all(p.exists() for p in needed)
    for path in needed:
        rel = path.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel


# ---- builds: the AVX2 build, the cache key, the status line, the fallback -----------------


def test_small_gemm_is_bit_identical_without_avx512(
    avx2_build: cpu_build.Build, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output is one in-order sum over k on either ISA: a CPU without AVX-512 computes the
    very same matmul results."""
    torch.manual_seed(11)
    weight, bias, x = torch.randn(96, 577), torch.randn(96), torch.randn(37, 577)
    panels = gemm.pack_panels(weight)
    assert panels is not None
    want = gemm.small_gemm(x, panels, bias)
    lib = avx2_build.library
    monkeypatch.setattr(cpu_build, "load_library", lambda extra_flags=(): lib)
    avx2_panels = gemm.pack_panels(weight)
    assert avx2_panels is not None and torch.equal(avx2_panels, panels)
    assert torch.equal(gemm.small_gemm(x, avx2_panels, bias), want)
    # its own row thresholds, answered by the build whose tiles they were measured for: past
    # its decode kernel, prompt chunks go to its own (16-register) prefill kernel tiles
    assert lib is not None and lib.cbgen_small_gemm_max_rows() > 0
    assert lib.cbgen_native_prefill_rows() > 0 and lib.cbgen_prefill_kernel_preferred()


def _other_node(here: cpu_build.Target) -> cpu_build.Target:
    """The same compiler on a CPU of another generation: AVX-512 where this one has none, or
    none where it has it."""
    macros = {k: v for k, v in here.macros.items() if not k.startswith("__AVX512")}
    if macros == dict(here.macros):
        macros |= {"__AVX512F__": "1", "__AVX512BF16__": "1"}
    return cpu_build.Target(here.compiler, here.version, macros)


def test_the_cache_key_names_compiler_version_and_target_isa() -> None:
    macros = {
        "__x86_64__": "1", "__tune_znver4__": "1", "__AVX512F__": "1", "__AVX512BF16__": "1",
        "__AVX2__": "1", "__FMA__": "1", "__GNUC__": "12", "__GNUC_MINOR__": "2",
    }  # fmt: skip
    zen4 = cpu_build.Target("/usr/bin/cc", "cc (Debian 12.2.0-14) 12.2.0", macros)
    assert zen4.describe() == "x86-64 znver4 avx512f avx512bf16 avx2 fma (gcc 12.2)"
    payload = b"sources and flags"
    key = zen4.key(payload)
    assert key == cpu_build.Target(zen4.compiler, zen4.version, dict(macros)).key(payload)
    others = [
        _other_node(zen4),
        cpu_build.Target("/opt/gcc13/bin/cc", zen4.version, macros),
        cpu_build.Target(zen4.compiler, "cc (Debian 13.1.0-1) 13.1.0", macros),
    ]
    assert len({key, *(t.key(payload) for t in others), zen4.key(payload + b" -O2")}) == 5
    avx2 = cpu_build.Target(
        "cc", "", {"__x86_64__": "1", "__AVX2__": "1", "__FMA__": "1", "__clang_major__": "17"}
    )
    assert avx2.describe() == "x86-64 avx2 fma (clang 17.0)"


def test_a_library_cached_for_another_target_is_never_loaded(tmp_path: Path) -> None:
    """A shared home folder holds a library built on another node: this node's loader looks
    only under its own key and loads the library built for it."""
    cc = cpu_build.find_compiler()
    assert cc is not None
    flags = tuple(cpu_build._FLAGS)
    payload = cpu_build.build_payload(flags)
    here = cpu_build.probe_target(cc, flags)
    elsewhere = _other_node(here)
    assert elsewhere.key(payload) != here.key(payload)
    foreign = tmp_path / f"cbgen_cpu_{elsewhere.key(payload)}.so"
    foreign.write_bytes(b"\x7fELF: a library for another CPU")
    # this node's build, as an earlier run left it (saves a compile here)
    built = cpu_build.build_library(cpu_build.cache_dir())
    assert built.path is not None and built.path.name == f"cbgen_cpu_{here.key(payload)}.so"
    shutil.copy(built.path, tmp_path / built.path.name)
    build = cpu_build.build_library(tmp_path)
    assert build.library is not None, build.status()
    assert build.path == tmp_path / built.path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.name, built.path.name])


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """load_library and native_status start over with their cache in tmp_path/cache, for this
    CPU's own ISA whatever CBGEN_CPU_ISA says; the real build is back after the test."""
    monkeypatch.setattr(cpu_build, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.delenv(ISA_SETTING, raising=False)
    cpu_build._build.cache_clear()
    cpu_build.load_library.cache_clear()
    yield tmp_path / "cache"
    cpu_build._build.cache_clear()
    cpu_build.load_library.cache_clear()


def _put_first_on_path(
    monkeypatch: pytest.MonkeyPatch, folder: Path, cc_script: str | None
) -> None:
    folder.mkdir()
    if cc_script is not None:
        (folder / "cc").write_text("#!/bin/sh\n" + cc_script)
        (folder / "cc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.parametrize("stage", ["probe", "compile"])
def test_a_failed_build_is_reported_with_the_compilers_words_in_a_log(
    fresh_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """A compiler that fails at once (even `cc --version`), or only when it compiles a source:
    no library, and the status line points to a log holding the command and its stderr."""
    real = cpu_build.find_compiler()
    script = 'echo "cc1: fatal error: this compiler is broken" >&2\nexit 1\n'
    if stage == "compile":
        script = (
            f'case " $* " in *" -c "*) {script.replace(chr(10), "; ")};; esac\nexec {real} "$@"\n'
        )
    _put_first_on_path(monkeypatch, tmp_path / "bin", script)
    assert cpu_build.load_library() is None
    logs = list(fresh_build.glob("build-*.log"))
    assert len(logs) == 1 and not list(fresh_build.glob("*.so"))
    assert (
        cpu_build.native_status()
        == f"native CPU kernels: unavailable (build failed, see {logs[0]})"
    )
    text = logs[0].read_text()
    assert "this compiler is broken" in text and str(tmp_path / "bin" / "cc") in text
    assert (" -c " in text) is (stage == "compile")


def test_no_compiler_is_reported(
    fresh_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cpu_build.load_library() is None
    assert cpu_build.native_status() == "native CPU kernels: unavailable (no C compiler)"


@pytest.fixture
def isa_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], cpu_build.Build]]:
    """The process's build made again under CBGEN_CPU_ISA=<isa> (in the usual cache: a lower
    ISA's library is kept beside the native one, under its own key); the default build is back
    after the test."""

    def build_for(isa: str) -> cpu_build.Build:
        monkeypatch.setenv(ISA_SETTING, isa)
        cpu_build._build.cache_clear()
        cpu_build.load_library.cache_clear()
        return cpu_build.native_build()

    yield build_for
    cpu_build._build.cache_clear()
    cpu_build.load_library.cache_clear()


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_the_isa_setting_builds_the_kernels_for_a_lower_isa_under_its_own_key(
    isa_build: Callable[[str], cpu_build.Build], isa: str
) -> None:
    """CBGEN_CPU_ISA=avx512 on a CPU with AVX-512 BF16 builds what an Ice Lake server builds,
    =avx2 what a Zen 3 builds: the macros, the code paths (the int16 head is the AVX2 build's
    default only) and the status line say so, the cache key differs, and the bf16 head (decided
    by the CPU's flags) is off under both."""
    from cbgen.cpu.linear import bf16_matmul_fast

    info = cpu_info()
    if not info.has_isa(isa):
        pytest.skip(f"this CPU lacks {'AVX-512' if isa == 'avx512' else 'AVX2 and FMA'}")
    native = isa_build("native")
    lowered = isa_build(isa)
    assert lowered.library is not None, lowered.status()
    assert lowered.path is not None and lowered.path != native.path
    assert lowered.reason.startswith("built for ") and lowered.reason.endswith(
        f", {ISA_SETTING}={isa}"
    )
    cc = cpu_build.find_compiler()
    assert cc is not None
    macros = cpu_build.probe_target(cc, (*cpu_build._FLAGS, *cpu_build.isa_flags(isa, info))).macros
    assert ("__AVX512F__" in macros) is (isa == "avx512") and "__AVX2__" in macros
    assert "__AVX512BF16__" not in macros and "__AMX_BF16__" not in macros
    assert ("avx512f" in lowered.reason) is (isa == "avx512") and "bf16" not in lowered.reason
    assert cpu_build.load_library() is lowered.library
    assert lowered.library.cbgen_head_i16_preferred() == (isa == "avx2")
    assert not bf16_matmul_fast()


def test_an_isa_this_cpu_lacks_is_refused(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for AVX-512 on an AVX2 CPU (or for a name it does not know), the loader builds
    nothing and says why: the engine runs on the torch paths."""
    monkeypatch.setattr(
        cpu_build, "cpu_info", lambda: CpuInfo("zen 3", "x86_64", frozenset({"avx2", "fma"}))
    )
    monkeypatch.setenv(ISA_SETTING, "avx512")
    assert cpu_build.load_library() is None
    assert cpu_build.native_status() == (
        "native CPU kernels: unavailable (CBGEN_CPU_ISA=avx512 asks for AVX-512 (avx512f), "
        "which this CPU does not have)"
    )
    assert not fresh_build.exists()  # nothing compiled, no log


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_without_the_kernels_the_engine_gives_the_same_greedy_tokens(
    kind: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler on a node: the engine runs on the torch paths, token for token as with
    the kernels (mixed prefill chunks and decodes)."""
    from cbgen.config import EngineConfig
    from cbgen.engine.engine import Engine
    from cbgen.llm import LLM
    from cbgen.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(tiny_model_dir(kind)), device="cpu", dtype="float32", kv_cache_memory=8 << 20,
        block_size=4, num_threads=1, max_num_batched_tokens=24,
    )  # fmt: skip
    prompts = [[1, 5, 9, 200, 17], list(range(30, 70)), [100, 3, 77, 42, 42, 9, 250, 17], [7] * 19]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run() -> tuple[Engine, list[list[int]]]:
        engine = Engine(config)
        return engine, [o.output_token_ids for o in LLM(engine=engine).generate(prompts, params)]

    with_kernels, want = run()
    assert isinstance(with_kernels.model.ops, CpuOps)
    assert isinstance(with_kernels.model.head_method, PackedF32Linear)
    assert with_kernels.model.head_method.panels is not None
    assert (
        "CPU " in with_kernels.describe()
        and "native CPU kernels: built for" in with_kernels.describe()
    )
    monkeypatch.setattr(cpu_build, "load_library", lambda extra_flags=(): None)
    without, got = run()
    assert without.model.ops is TORCH_OPS
    assert getattr(without.model.head_method, "panels", None) is None
    assert got == want and all(len(t) == 24 for t in got)


# ---- argument checks that hold under python -O --------------------------------------------


def test_wrong_dtypes_and_shapes_raise_before_any_pointer_reaches_c() -> None:
    x, panels = torch.randn(3, 64), torch.randn(3, 64, gemm.PANEL)
    kv = torch.randn(2, 4, 16, 2, 64)
    bt, sl = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    residual, weight = torch.randn(5, 64), torch.ones(64)
    before = residual.clone()
    cos = torch.randn(32, 16)
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: gemm.small_gemm(x.double(), panels, None), TypeError, "x: expected torch.float32, got torch.float64"),
        (lambda: gemm.small_gemm(torch.randn(3, 65), panels, None), ValueError, r"x: expected shape \[M, 64\], got \[3, 65\]"),
        (lambda: gemm.small_gemm(x, panels, torch.randn(95)), ValueError, r"bias: expected shape \[96\]"),
        (lambda: gemm.small_gemm(x, panels[:, :, :16], None), ValueError, "panels: expected shape"),
        (lambda: kernels.silu_mul(torch.randn(3, 7)), ValueError, "gate_up: expected an even number of columns"),
        (lambda: kernels.silu_mul(torch.randn(3, 8).half()), TypeError, "gate_up: expected torch.float32"),
        (lambda: kernels.add_rmsnorm_(residual, None, torch.ones(63), 1e-6), ValueError, r"weight: expected shape \[64\]"),
        (lambda: kernels.add_rmsnorm_(residual, torch.randn(64, 5).t(), weight, 1e-6), ValueError, "x: expected a contiguous"),
        (lambda: kernels.rope_(torch.randn(3, 128), 2, 32, torch.zeros(3, dtype=torch.int32), cos, cos), TypeError, "positions: expected torch.int64"),
        (lambda: kernels.rope_(torch.randn(3, 64), 4, 32, torch.zeros(3, dtype=torch.int64), cos, cos), ValueError, "x: rows of 4 heads x 32"),
        (lambda: kernels.paged_decode_f32(torch.randn(2, 4, 64), kv, bt.long(), sl, 0.1), TypeError, "block_table: expected torch.int32"),
        (lambda: kernels.paged_decode_f32(torch.randn(2, 4, 64), kv[..., :32], bt, sl, 0.1), ValueError, r"kv_cache: expected shape \[2, num_blocks, block_size, Hkv, 64\]"),
        (lambda: kernels.paged_decode_f32(torch.randn(2, 4, 64), kv[:, :, :8], bt, sl, 0.1), ValueError, "kv_cache: expected a contiguous"),
        (lambda: kernels.paged_decode_f32(torch.randn(3, 4, 64), kv, bt, sl, 0.1), ValueError, r"block_table: expected shape \[3, n\]"),
        (lambda: kernels.paged_decode_f32(torch.randn(2, 3, 64), kv, bt, sl, 0.1), ValueError, "not a multiple of the cache's 2 KV heads"),
        (lambda: kernels.sample(torch.randn(2, 10), torch.ones(3), torch.rand(2)), ValueError, r"temperature: expected shape \[2\]"),
        (lambda: kernels.prefill_attention_f32(torch.randn(4, 2, 64), torch.randn(4, 2, 32), torch.randn(4, 2, 32), 0.1), ValueError, "key: expected shape"),
        (lambda: kernels.prefill_attention_f32(torch.randn(5, 2, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), 0.1), ValueError, "cannot serve a query of 5"),
        (lambda: kernels.exp_sub_sum_(torch.randn(8).double(), 0.0), TypeError, "scores: expected torch.float32"),
        (lambda: head_kernels.head_bf16(torch.randn(2, 8), x[:2], x[:2].bfloat16(), torch.randn(8, 64), torch.ones(8), torch.ones(8), (0.0, 1.0, 0.0, 0.0), torch.zeros(2), torch.zeros(2), 1), TypeError, "logits: expected torch.bfloat16"),
        (lambda: gemm.pack_panels(torch.randn(96)), ValueError, "weight: expected a 2-D CPU tensor"),
    ]  # fmt: skip
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert torch.equal(residual, before)  # a refused call wrote nothing


def test_the_checks_hold_under_python_optimisations() -> None:
    """`python -O` strips assert statements; the wrappers' checks are not asserts."""
    code = (
        "import torch\n"
        "from cbgen.cpu import gemm\n"
        "assert False, 'assert statements still run'\n"
        "try:\n"
        "    gemm.small_gemm(torch.randn(2, 64, dtype=torch.float64), torch.randn(3, 64, 32), None)\n"
        "except TypeError as e:\n"
        "    print('refused:', e)\n"
    )
    root = REPO
    done = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused: x: expected torch.float32, got torch.float64"
