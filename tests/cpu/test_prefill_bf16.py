"""The bf16 prefill attention (cbgen_prefill_attention_bf16): bf16 dot products over a bf16
cache's rows, the query and the softmax's probabilities rounded to bf16, every sum in float32.
Checked against float64 attention on the same rounded query and K/V, within the error that
rounding each probability to bf16 allows (half an ulp of 8 bits: 2^-9 of each term of P x V;
the bound below is twice that, plus float32's sums); builds without bf16 dot products decline
it (None) and keep the float32 kernel."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import attention_weights_float64

from cbgen.cpu import bf16, build, kernels

pytestmark = [
    pytest.mark.skipif(build.load_library() is None, reason=build.native_status()),
    pytest.mark.usefixtures("each_build"),
]


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> None:
    got = kernels.prefill_attention_bf16(q, k, v, scale, window, cap)
    if not bf16.native():
        assert got is None  # the float32 kernel serves instead
        return
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    group = q.shape[1] // k.shape[1]
    weights = attention_weights_float64(q.bfloat16(), k, scale, window, cap)  # [H, Q, L]
    vv = v.double().repeat_interleave(group, 1)  # [L, H, D]
    want = torch.einsum("hqk,khd->qhd", weights, vv)
    bound = 2.0**-8 * torch.einsum("hqk,khd->qhd", weights, vv.abs()) + 1e-5
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (err - bound).max()
    # and it is not the float32 kernel's answer: the rounding is there
    exact = kernels.prefill_attention_f32(q, k.float(), v.float(), scale, window, cap)
    assert exact is not None and not torch.equal(exact, got)


@pytest.mark.parametrize(
    ("qlen", "ctx", "heads", "kv_heads", "d"),
    [
        (2, 0, 9, 3, 64),  # two rows, an odd number of keys for the first
        (7, 0, 9, 3, 64),  # fewer rows than a work item
        (37, 16, 9, 3, 64),  # cached context, rows not a multiple of 8
        (33, 31, 4, 1, 64),  # keys cross a step mid-item, an odd count
        (100, 0, 4, 4, 128),  # no GQA, D = 128
        (64, 201, 8, 2, 128),  # long context before a short chunk
        (300, 0, 9, 3, 64),
    ],
)
def test_bf16_prefill_attention_is_float64_attention_on_the_rounded_inputs(
    qlen: int, ctx: int, heads: int, kv_heads: int, d: int
) -> None:
    torch.manual_seed(qlen + ctx)
    q = torch.randn(qlen, heads, d) * 2
    k = torch.randn(ctx + qlen, kv_heads, d).bfloat16()
    v = torch.randn(ctx + qlen, kv_heads, d).bfloat16()
    _check(q, k, v, d**-0.5)


@pytest.mark.parametrize(("window", "cap"), [(17, None), (None, 5.0), (40, 30.0)])
def test_bf16_prefill_attention_applies_the_window_and_the_cap(
    window: int | None, cap: float | None
) -> None:
    torch.manual_seed(11)
    q = torch.randn(90, 8, 64) * 3
    k, v = torch.randn(150, 2, 64).bfloat16(), torch.randn(150, 2, 64).bfloat16()
    _check(q, k, v, 0.125, window, cap)


def test_bf16_prefill_attention_keeps_nan_to_the_rows_that_see_it_and_refuses_what_it_cannot() -> (
    None
):
    torch.manual_seed(9)
    q = torch.randn(40, 6, 64)
    k, v = torch.randn(50, 2, 64).bfloat16(), torch.randn(50, 2, 64).bfloat16()
    k[30, 1, 5] = float("nan")  # key position 30, KV head 1: query rows from 20 on see it
    got = kernels.prefill_attention_bf16(q, k, v, 0.125)
    if bf16.native():
        assert got is not None
        assert got[20:, 3:].isnan().all()
        assert not got[:20].isnan().any() and not got[:, :3].isnan().any()
    else:
        assert got is None
    # a float32 K/V is the float32 kernel's; a head size other than 64 or 128 the reference's
    assert kernels.prefill_attention_bf16(q, k.float(), v.float(), 0.125) is None
    small = torch.randn(4, 2, 32).bfloat16()
    assert kernels.prefill_attention_bf16(torch.randn(4, 2, 32), small, small, 0.2) is None
    with pytest.raises(ValueError, match="key: expected shape"):
        kernels.prefill_attention_bf16(torch.randn(4, 2, 64), small, small, 0.1)
