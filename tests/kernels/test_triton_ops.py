"""TritonOps (the element-wise Triton kernels behind the model's Ops interface) against TorchOps,
the reference: each op on random inputs of odd sizes, then a tiny Llama's greedy tokens.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set at the top
of this module, before triton is first imported; see tests/kernels/test_kernels.py). With CUDA the same
tests run the compiled kernels on the GPU.

Tolerances. The kernels round where the reference rounds and launch without fused
multiply-adds, so
  - the residual stream (residual += h) and RoPE are bit-identical in both dtypes;
  - RMSNorm sums its squares in another order: float32 within 1e-6 relative (observed 2.7e-7,
    a few ulps), bfloat16 within one bfloat16 ulp (2^-7 relative; the float32 difference can
    move a value across a rounding boundary);
  - SiLU's exp is not torch's: the same bounds.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path

import cbgen_kernels
import pytest

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.ops import TORCH_OPS
from cbgen.models.triton_ops import TritonOps
from cbgen.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
RTOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
OPS = TritonOps() if cbgen_kernels.interpreted() or DEVICE.type == "cuda" else None


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    if OPS is None:
        pytest.fail(
            "cbgen_kernels was imported without TRITON_INTERPRET=1 (triton was imported before "
            "this module set it), so its kernels cannot run on the CPU"
        )


def ops() -> TritonOps:
    assert OPS is not None
    return OPS


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=ATOL[want.dtype])


@DTYPES
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_add_rmsnorm_matches_torch_ops(dtype: torch.dtype, hidden: int, tokens: int) -> None:
    """h is a column slice of a wider tensor (strided rows); residual values of mixed scales."""
    residual = randn(tokens, hidden, seed=tokens, dtype=dtype, scale=3.0)
    h = randn(tokens, hidden + 5, seed=hidden, dtype=dtype)[:, 2 : hidden + 2]
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    weight = weight.to(DEVICE)
    want_residual = residual + h
    mine, theirs = residual.clone(), residual.clone()
    got = ops().add_rmsnorm_(mine, h, weight, 1e-6)
    want = TORCH_OPS.add_rmsnorm_(theirs, h, weight, 1e-6)
    assert torch.equal(mine, want_residual)  # the residual stream is bit-identical
    assert_close(got, want)


@DTYPES
def test_add_rmsnorm_without_h_leaves_the_residual(dtype: torch.dtype) -> None:
    residual = randn(7, 576, seed=3, dtype=dtype, scale=2.0)
    weight = randn(576, seed=4, dtype=dtype)
    before = residual.clone()
    got = ops().add_rmsnorm_(residual, None, weight, 1e-5)
    assert torch.equal(residual, before)
    assert_close(got, TORCH_OPS.add_rmsnorm_(before, None, weight, 1e-5))


def test_add_rmsnorm_rejects_mixed_dtypes() -> None:
    residual = randn(2, 64, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight is torch\.bfloat16"):
        ops().add_rmsnorm_(
            residual, None, torch.ones(64, dtype=torch.bfloat16, device=DEVICE), 1e-6
        )


def rope_tables(head_dim: int, max_pos: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rope_on_strided_qkv_rows_is_bit_identical(
    dtype: torch.dtype, head_dim: int, tokens: int
) -> None:
    """q and k heads (5 + 1) rotated in rows of qkv whose v columns stay as they were."""
    heads, kv_heads = 5, 1
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens, dtype=dtype, scale=2.0)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(7))
    positions[0] = 511  # the table's last row
    positions = positions.to(DEVICE)
    cos, sin = rope_tables(head_dim)
    rotated = heads + kv_heads
    want, got = qkv.clone(), qkv.clone()
    TORCH_OPS.rope_(want, rotated, head_dim, TORCH_OPS.rope_tables(cos, sin, positions, dtype))
    ops().rope_(got, rotated, head_dim, ops().rope_tables(cos, sin, positions, dtype))
    assert torch.equal(got, want)
    assert not torch.equal(got[:, : rotated * head_dim], qkv[:, : rotated * head_dim])
    assert torch.equal(got[:, rotated * head_dim :], qkv[:, rotated * head_dim :])


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: half a head is not a power of two
def test_rope_on_contiguous_heads(dtype: torch.dtype, head_dim: int) -> None:
    """The Q/K-norm path hands over q alone: rows of exactly num_heads * head_dim."""
    q = randn(9, 3 * head_dim, seed=5, dtype=dtype)
    positions = torch.arange(9, device=DEVICE) * 50
    cos, sin = rope_tables(head_dim)
    want, got = q.clone(), q.clone()
    TORCH_OPS.rope_(want, 3, head_dim, TORCH_OPS.rope_tables(cos, sin, positions, dtype))
    ops().rope_(got, 3, head_dim, ops().rope_tables(cos, sin, positions, dtype))
    assert torch.equal(got, want)


@DTYPES
@pytest.mark.parametrize("rotary", [48, 32])  # Phi-4-mini's 0.75 of 64; half of it
def test_partial_rotary_turns_the_first_dims_of_each_head(dtype: torch.dtype, rotary: int) -> None:
    """Tables for rotary < head_dim dims: those of each head turn, the rest pass through."""
    head_dim, heads = 64, 3
    q = randn(9, heads * head_dim, seed=rotary, dtype=dtype, scale=2.0)
    positions = torch.arange(9, device=DEVICE) * 37
    cos, sin = rope_tables(rotary)
    want, got = q.clone(), q.clone()
    TORCH_OPS.rope_(want, heads, head_dim, TORCH_OPS.rope_tables(cos, sin, positions, dtype))
    ops().rope_(got, heads, head_dim, ops().rope_tables(cos, sin, positions, dtype))
    assert torch.equal(got, want)
    by_head, before = got.view(9, heads, head_dim), q.view(9, heads, head_dim)
    assert torch.equal(by_head[..., rotary:], before[..., rotary:])
    assert not torch.equal(by_head[1:, :, :rotary], before[1:, :, :rotary])


@DTYPES
@pytest.mark.parametrize("inter", [48, 1100])  # 1100: two programs a row, the second masked
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_silu_mul_matches_torch_ops(dtype: torch.dtype, inter: int, tokens: int) -> None:
    gate_up = randn(tokens, 2 * inter, seed=inter + tokens, dtype=dtype, scale=4.0)
    assert_close(ops().silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up))


def test_empty_batches() -> None:
    x = torch.empty(0, 128, device=DEVICE)
    assert ops().add_rmsnorm_(x, x, torch.ones(128, device=DEVICE), 1e-6).shape == (0, 128)
    assert ops().silu_mul(x).shape == (0, 64)
    cos, sin = rope_tables(64)
    ops().rope_(x, 2, 64, ops().rope_tables(cos, sin, torch.empty(0, dtype=torch.long), x.dtype))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190]]


def _greedy(engine: Engine) -> list[list[int]]:
    outs = LLM(engine=engine).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.output_token_ids for o in outs]


def test_tiny_llama_greedy_tokens_match_torch_ops(tiny_model_dir: Callable[[str], Path]) -> None:
    """The whole forward on TritonOps (chunked prefill in 8-token chunks, then decodes) gives
    TorchOps' greedy tokens, in float32."""
    cfg = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device="cuda" if DEVICE.type == "cuda" else "cpu",
        dtype="float32",
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=8,
        attention_backend="torch",
    )
    reference = Engine(cfg)
    model = reference.model
    calls: list[str] = []
    triton_ops = TritonOps()
    original = triton_ops.add_rmsnorm_

    def counted(
        residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        calls.append("add_rmsnorm_")
        return original(residual, h, weight, eps)

    triton_ops.add_rmsnorm_ = counted  # type: ignore[method-assign]
    loaded = model.ops
    try:
        model.ops = TORCH_OPS
        want = _greedy(reference)
        model.ops = triton_ops
        got = _greedy(Engine(cfg, share_weights_with=reference))
    finally:
        model.ops = loaded
    assert got == want
    assert calls  # the forward really ran on the Triton ops


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loader_picks_triton_ops_on_cuda(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir("llama")), device="cuda", kv_cache_memory=16 << 20)
    )
    assert isinstance(engine.model.ops, TritonOps)
