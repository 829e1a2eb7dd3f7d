"""rope_write_kv_ (RoPE on q and k fused with the new K/V's write into the paged cache) against
the two launches it replaces, rope_ then write_kv_cache, and against the torch references
(TorchOps.rope_, torch_backend.write_kv_cache): every tensor it touches equal bit for bit, in
float32, bfloat16 and float16. Then tiny Llama and Qwen2 models on the triton backend, their
forward taking the fused path, give transformers' greedy tokens.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set at the top
of this module, before triton is first imported; see tests/kernels/test_kernels.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbgen_kernels
import pytest
from helpers.kernels import triton_kernels_can_run
from helpers.models import tiny_engine
from helpers.reference import hf_greedy

from cbgen.attention import torch_backend
from cbgen.llm import LLM
from cbgen.models.ops import TORCH_OPS, RopeKvOps
from cbgen.models.triton_ops import TritonOps
from cbgen.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
PAGE = 4
BLOCKS = 6


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    triton_kernels_can_run(DEVICE)


class Case:
    """qkv rows (strided: two spare columns each), float32 tables of `rotary` dims, a cache
    filled with noise, and slots that skip token 1 (-1) and reach the cache's last slot."""

    def __init__(
        self,
        tokens: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        rotary: int | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + head_dim)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = (heads + 2 * kv_heads) * head_dim
        wide = torch.randn(tokens, width + 2, generator=g) * 2.0
        self.qkv = wide.to(dtype).to(DEVICE)[:, 1 : width + 1]
        rotary = rotary or head_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
        freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos, self.sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
        positions = torch.randint(0, 512, (tokens,), generator=g)
        positions[0] = 511
        self.positions = positions.to(DEVICE)
        self.kv_cache = torch.randn(2, BLOCKS, PAGE, kv_heads, head_dim, generator=g)
        self.kv_cache = self.kv_cache.to(dtype).to(DEVICE)
        slots = torch.randperm(BLOCKS * PAGE, generator=g)[:tokens]
        slots[0] = BLOCKS * PAGE - 1
        if tokens > 1:
            slots[1] = -1
        self.slots = slots.to(DEVICE)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, cache = self.qkv.clone(), self.kv_cache.clone()
        cbgen_kernels.rope_write_kv_(
            qkv,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.positions,
            self.cos,
            self.sin,
            cache,
            self.slots,
        )
        return qkv, cache

    def split(self, torch_reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE, then the write of k and v, as two launches (or the torch references)."""
        qkv, cache = self.qkv.clone(), self.kv_cache.clone()
        rotated, d = self.heads + self.kv_heads, self.head_dim
        if torch_reference:
            tables = TORCH_OPS.rope_tables(self.cos, self.sin, self.positions, qkv.dtype)
            TORCH_OPS.rope_(qkv, rotated, d, tables)
        else:
            cbgen_kernels.rope_(qkv, rotated, d, self.positions, self.cos, self.sin)
        t = qkv.shape[0]
        k = qkv[:, self.heads * d : rotated * d].view(t, self.kv_heads, d)
        v = qkv[:, rotated * d :].view(t, self.kv_heads, d)
        write = torch_backend.write_kv_cache if torch_reference else cbgen_kernels.write_kv_cache
        write(k, v, cache, self.slots)
        return qkv, cache


def assert_fused_equals_split(case: Case) -> None:
    got_qkv, got_cache = case.fused()
    for torch_reference in (False, True):
        want_qkv, want_cache = case.split(torch_reference)
        assert torch.equal(got_qkv, want_qkv)
        assert torch.equal(got_cache, want_cache)
    # what the kernel changed: the q and k columns, and the cache at the real slots only
    rotated = (case.heads + case.kv_heads) * case.head_dim
    assert not torch.equal(got_qkv[:, :rotated], case.qkv[:, :rotated])
    assert torch.equal(got_qkv[:, rotated:], case.qkv[:, rotated:])
    flat_got = got_cache.flatten(1, 2)
    flat_before = case.kv_cache.flatten(1, 2)
    written = case.slots[case.slots >= 0]
    untouched = torch.ones(BLOCKS * PAGE, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(flat_got[:, untouched], flat_before[:, untouched])
    assert not torch.equal(flat_got[:, written], flat_before[:, written])


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: half a head is no power of two
@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_equals_rope_then_write(dtype: torch.dtype, head_dim: int, tokens: int) -> None:
    """GQA 3:1 (three q heads, a non-power-of-two count, share one KV head)."""
    assert_fused_equals_split(Case(tokens, 3, 1, head_dim, dtype))


@DTYPES
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 8), (6, 3)])
def test_fused_equals_rope_then_write_gqa(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    assert_fused_equals_split(Case(5, heads, kv_heads, 32, dtype))


@DTYPES
@pytest.mark.parametrize(("head_dim", "rotary"), [(64, 48), (64, 32), (96, 24)])
def test_fused_partial_rotary(dtype: torch.dtype, head_dim: int, rotary: int) -> None:
    """The first `rotary` dims of each head turn; the rest of k reach the cache unchanged."""
    case = Case(5, 4, 2, head_dim, dtype, rotary=rotary)
    assert_fused_equals_split(case)
    qkv, cache = case.fused()
    t, q_cols = qkv.shape[0], 4 * head_dim
    k = qkv[:, q_cols : q_cols + 2 * head_dim].view(t, 2, head_dim)
    k_before = case.qkv[:, q_cols : q_cols + 2 * head_dim].view(t, 2, head_dim)
    assert torch.equal(k[..., rotary:], k_before[..., rotary:])
    slot = int(case.slots[0])
    assert torch.equal(cache[0, slot // PAGE, slot % PAGE], k[0])


def test_all_slots_negative_rotates_and_writes_nothing() -> None:
    case = Case(3, 4, 2, 64, torch.float32)
    case.slots = torch.full_like(case.slots, -1)
    qkv, cache = case.fused()
    assert torch.equal(cache, case.kv_cache)
    assert torch.equal(qkv, case.split(torch_reference=True)[0])


def test_empty_batch_and_misfits() -> None:
    case = Case(2, 4, 2, 64, torch.float32)
    empty = case.qkv[:0]
    cbgen_kernels.rope_write_kv_(
        empty, 4, 2, 64, case.positions[:0], case.cos, case.sin, case.kv_cache, case.slots[:0]
    )
    with pytest.raises(ValueError, match=r"rope_write_kv_: a cache of shape .* 3 KV heads"):
        cbgen_kernels.rope_write_kv_(
            case.qkv, 2, 3, 64, case.positions, case.cos, case.sin, case.kv_cache, case.slots
        )
    with pytest.raises(ValueError, match=r"rope_write_kv_: x must be \[T, >= 576\]"):
        cbgen_kernels.rope_write_kv_(
            case.qkv, 5, 2, 64, case.positions, case.cos, case.sin, case.kv_cache, case.slots
        )
    with pytest.raises(ValueError, match="slot_mapping of shape"):
        cbgen_kernels.rope_write_kv_(
            case.qkv, 4, 2, 64, case.positions, case.cos, case.sin, case.kv_cache, case.slots[:1]
        )


# ---- a whole model on the fused path ----------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12]]
NEW_TOKENS = 4


class CountingTritonOps(TritonOps):
    """TritonOps that count their fused RoPE + K/V writes."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_calls = 0

    def rope_write_kv_(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tables: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self.fused_calls += 1
        super().rope_write_kv_(
            qkv, num_heads, num_kv_heads, head_dim, tables, kv_cache, slot_mapping
        )


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_on_the_fused_path_matches_transformers(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """The triton backend with TritonOps: every layer of every step rotates and writes K/V in
    one launch (counted), with chunked prefill over cached context and 4-token blocks."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    engine = tiny_engine(
        folder,
        device=DEVICE.type,
        attention_backend="triton",
        max_num_batched_tokens=8,
        enforce_eager=True,  # on CUDA: every step through the forward below, none replayed
    )
    ops = CountingTritonOps()
    assert isinstance(ops, RopeKvOps) and engine.backend.attends_written_kv
    engine.model.ops = ops
    outs = LLM(engine=engine).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    assert [o.output_token_ids for o in outs] == want
    layers = engine.model_config.num_hidden_layers
    assert ops.fused_calls >= layers * NEW_TOKENS and ops.fused_calls % layers == 0
