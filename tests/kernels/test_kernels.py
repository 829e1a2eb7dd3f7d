"""The Triton kernels of cbgen_kernels against their torch references, on random inputs.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set
before triton is first imported in the process, so this module sets it at the top, before
importing triton or cbgen_kernels (pytest imports every test module of a worker at collection,
before any test runs). With CUDA the same tests run the compiled kernels on the GPU.

Tolerances (max abs error against float32 math on the same inputs):
  float32: 2e-5 (observed <= 1e-6: only the summation order differs)
  bfloat16: 3e-2 (outputs are rounded to bfloat16, |out| < 4, ulp 1.6e-2 near 4; the kernel
            keeps float32 accumulators and rounds P to bfloat16 before P @ V, as the reference
            SDPA does in its own order)
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cbgen_kernels
import pytest
from helpers.kernels import triton_kernels_can_run

from cbgen.attention import torch_backend as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _kernels_can_run() -> None:
    triton_kernels_can_run(DEVICE)


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor  # [B, width] int32, wider than needed, scattered block ids
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    scale: float


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """A flat batch over a randomly filled cache; each sequence reads a random, scattered set
    of blocks, and the table has two spare columns of valid but foreign block ids (a kernel
    that reads past seq_len picks up wrong keys)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    width = max(-(-s // block_size) for s in seq_lens) + 2
    num_blocks = len(seq_lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * width]
    block_table = perm.view(len(seq_lens), width).to(torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return Batch(
        query.to(DEVICE),
        kv_cache.to(DEVICE),
        block_table.to(DEVICE),
        qsl.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        head_dim**-0.5,
    )


def reference(b: Batch) -> torch.Tensor:
    """torch_backend.paged_attention in float32 on the same (possibly bf16) inputs."""
    return ref.paged_attention(
        b.query.float(), b.kv_cache.float(), b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float() - want).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err} > {ATOL[dtype]}"


# Each batch as (query_lens, context_lens). seq_len = context + query; block sizes 16 and 32.
BATCHES = {
    # prefill chunk over cached context (crossing blocks), a decode, a fresh prompt, a decode
    "mixed": ([7, 1, 20, 1], [25, 40, 0, 15]),
    # decodes only: seq_len 1 (first token), 17 and 33 (just past a block), 64 (block end)
    "decodes": ([1, 1, 1, 1], [0, 16, 32, 63]),
    # one chunk of 37 tokens after 29 cached ones: several query tiles, causal inside
    "chunk": ([37], [29]),
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_mixed_batch(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    b = make_batch(
        *BATCHES["mixed"], block_size=block_size, group=group, head_dim=head_dim, dtype=dtype
    )
    got = cbgen_kernels.paged_attention(
        b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )
    assert_close(got, reference(b), dtype)


@pytest.mark.parametrize("kind", ["decodes", "chunk"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_decodes_and_chunks(kind: str, block_size: int, dtype: torch.dtype) -> None:
    b = make_batch(*BATCHES[kind], block_size=block_size, group=4, head_dim=64, dtype=dtype, seed=1)
    got = cbgen_kernels.paged_attention(
        b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )
    assert_close(got, reference(b), dtype)


def test_paged_attention_matches_torch_reference_in_its_own_dtype() -> None:
    """Same signature, same answer: the kernel against torch_backend.paged_attention called
    with the very same bf16 arguments (both round to bf16 at the end)."""
    b = make_batch(*BATCHES["mixed"], group=4, dtype=torch.bfloat16, seed=2)
    args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale)
    got, want = cbgen_kernels.paged_attention(*args), ref.paged_attention(*args)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() <= 3e-2


def test_query_tiles_span_sequences_of_every_length() -> None:
    """Many sequences whose query lengths straddle the 64-row tile (GQA 1: 64 tokens a tile),
    so tile numbering (qsl[i] // BLOCK_Q + i) and the binary search meet every case."""
    query_lens = [1, 63, 64, 65, 2, 1, 130]
    b = make_batch(
        query_lens, [3, 0, 1, 16, 0, 70, 5], num_kv_heads=1, group=1, head_dim=64, seed=3
    )
    got = cbgen_kernels.paged_attention(
        b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )
    assert_close(got, reference(b), torch.float32)


@pytest.mark.parametrize(
    ("num_splits", "group", "head_dim", "dtype"),
    [(2, 8, 128, torch.float32), (3, 1, 64, torch.float32), (4, 4, 128, torch.bfloat16)],
    ids=["2-fp32", "3-fp32", "4-bf16"],
)
def test_split_kv_decodes(num_splits: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    """Decodes over contexts from 1 to 200 keys: some splits of the short ones are empty
    (lse = -inf) and must weigh nothing in the merge."""
    b = make_batch(
        [1, 1, 1], [199, 0, 70], num_kv_heads=1, group=group, head_dim=head_dim, dtype=dtype, seed=4
    )
    got = cbgen_kernels.paged_attention_split_kv(
        b.query,
        b.kv_cache,
        b.block_table,
        b.query_start_loc,
        b.seq_lens,
        b.scale,
        num_splits=num_splits,
    )
    assert_close(got, reference(b), dtype)


def test_split_kv_is_correct_on_a_mixed_batch() -> None:
    """The split path is meant for decodes but keeps the contract for any batch, with causal
    rows whose limit falls inside, before or after a split's range."""
    b = make_batch(*BATCHES["mixed"], block_size=16, group=4, head_dim=64, seed=5)
    args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale)
    got = cbgen_kernels.paged_attention_split_kv(*args, num_splits=3)
    assert_close(got, reference(b), torch.float32)


def test_split_kv_workspace_is_reused_and_one_split_is_the_plain_kernel() -> None:
    b = make_batch([1, 1], [100, 7], group=2, seed=6)
    args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale)
    ws = cbgen_kernels.SplitWorkspace.allocate(2, 2, 4, 64, DEVICE)
    ptr = ws.partial.data_ptr()
    got = cbgen_kernels.paged_attention_split_kv(*args, num_splits=2, workspace=ws)
    assert ws.partial.data_ptr() == ptr
    assert_close(got, reference(b), torch.float32)
    one = cbgen_kernels.paged_attention_split_kv(*args, num_splits=1)
    assert torch.equal(one, cbgen_kernels.paged_attention(*args))
    with pytest.raises(ValueError, match="num_splits"):
        cbgen_kernels.paged_attention_split_kv(*args, num_splits=0)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (2, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_cache_matches_reference(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Strided key/value (views into one fused QKV output, as the model passes them), slots
    across several blocks including the last slot of the cache, and negative (padded) slots
    that must leave the cache untouched. A copy: the result is exact."""
    g = torch.Generator().manual_seed(7)
    num_blocks, t = 4, 9
    q_size, kv_size = 2 * num_kv_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(t, q_size + 2 * kv_size, generator=g).to(dtype).to(DEVICE)
    _, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    key = key.view(t, num_kv_heads, head_dim)
    value = value.view(t, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    last = num_blocks * block_size - 1
    slots = torch.tensor([0, -1, block_size - 1, block_size, last, -5, 2 * block_size + 3, 5, -1])
    cache = (
        torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
        .to(dtype)
        .to(DEVICE)
    )
    want = cache.clone()
    ref.write_kv_cache(key, value, want, slots.to(DEVICE))
    cbgen_kernels.write_kv_cache(key, value, cache, slots.to(DEVICE))
    assert torch.equal(cache, want)


def test_write_kv_cache_all_negative_and_empty() -> None:
    cache = torch.randn(2, 2, 16, 2, 64, device=DEVICE)
    before = cache.clone()
    k = torch.randn(3, 2, 64, device=DEVICE)
    cbgen_kernels.write_kv_cache(k, k, cache, torch.full((3,), -1, device=DEVICE))
    cbgen_kernels.write_kv_cache(
        k[:0], k[:0], cache, torch.empty(0, dtype=torch.long, device=DEVICE)
    )
    assert torch.equal(cache, before)


def test_write_then_attend_equals_reference_end_to_end() -> None:
    """A prefill chunk's new K/V written by the kernel, then attended by the kernel, equals
    the torch path doing both (the order the backends run them in)."""
    b = make_batch([5, 1, 12], [20, 30, 0], group=4, seed=8)
    g = torch.Generator().manual_seed(9)
    t, hkv, d = b.query.shape[0], 2, 64
    key = torch.randn(t, hkv, d, generator=g).to(DEVICE)
    value = torch.randn(t, hkv, d, generator=g).to(DEVICE)
    bs = b.kv_cache.shape[2]
    slots = []
    qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i in range(len(lens)):
        for j in range(qsl[i + 1] - qsl[i]):
            pos = lens[i] - (qsl[i + 1] - qsl[i]) + j
            slots.append(int(b.block_table[i, pos // bs]) * bs + pos % bs)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    cache_ref = b.kv_cache.clone()
    ref.write_kv_cache(key, value, cache_ref, slot_mapping)
    want = ref.paged_attention(
        b.query, cache_ref, b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )
    cbgen_kernels.write_kv_cache(key, value, b.kv_cache, slot_mapping)
    got = cbgen_kernels.paged_attention(
        b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale
    )
    assert_close(got, want, torch.float32)


# ---- no recompiles mid-run ------------------------------------------------------------------


class _Recorder:
    """Stands in for a jit kernel: records the arguments of every launch, then launches it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **constexprs: Any) -> Any:
            variant = tuple(sorted(constexprs.items()))
            self.calls.append((variant, dict(zip(self.kernel.arg_names, args, strict=False))))
            return self.kernel[grid](*args, **constexprs)

        return launch

    def varying_int_args(self) -> set[str]:
        """Integer arguments that took more than one value within one compiled variant (the
        same constexprs)."""
        seen: dict[tuple[Any, ...], dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
        for variant, args in self.calls:
            for name, value in args.items():
                if isinstance(value, int):
                    seen[variant][name].add(value)
        return {name for values in seen.values() for name, v in values.items() if len(v) > 1}

    def unspecialised(self) -> set[str]:
        """The arguments the kernel exempts from Triton's value specialisation."""
        k = self.kernel
        names = (
            k.kwargs.get("do_not_specialize")
            if cbgen_kernels.interpreted()
            else k.do_not_specialize
        )
        return {k.arg_names[n] if isinstance(n, int) else n for n in names or ()}


def test_arguments_that_change_from_step_to_step_are_not_specialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton compiles a kernel anew for each specialisation of an integer argument (equal to
    1, divisible by 16); the interpreter cannot count compiles, so record what the launchers
    pass over the steps of one model shape (sequence counts, token counts and longest contexts,
    hence block-table widths, all differ) and require that every integer argument whose value
    changed within one compiled variant is exempt. The results stay right at every width."""
    from cbgen_kernels import attention, cache

    recorders = {}
    for module, name in (
        (attention, "_paged_attention_kernel"),
        (attention, "_merge_splits_kernel"),
        (cache, "_write_kv_kernel"),
    ):
        recorders[name] = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    steps = [
        ([1], [5]),
        ([1, 1, 1], [40, 3, 70]),
        ([1] * 5, [15, 16, 17, 200, 1]),
        ([4, 1], [0, 33]),
        ([9, 1, 1], [100, 0, 47]),
    ]
    for i, (query_lens, context_lens) in enumerate(steps):
        b = make_batch(query_lens, context_lens, seed=20 + i)
        args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale)
        assert_close(cbgen_kernels.paged_attention(*args), reference(b), torch.float32)
        if max(query_lens) == 1:
            assert_close(
                cbgen_kernels.paged_attention_split_kv(*args, num_splits=3),
                reference(b),
                torch.float32,
            )
        kv = b.query[:, :2]  # [T, 2 KV heads, 64], strided like the model's views
        slots = torch.arange(kv.shape[0], device=DEVICE) * 3
        want = b.kv_cache.clone()
        ref.write_kv_cache(kv, kv, want, slots)
        cbgen_kernels.write_kv_cache(kv, kv, b.kv_cache, slots)
        assert torch.equal(b.kv_cache, want)
    attention_varying = recorders["_paged_attention_kernel"].varying_int_args()
    assert {
        "num_seqs",
        "stride_block_table",
        "stride_out_split",
        "stride_lse_split",
    } <= attention_varying
    for name, rec in recorders.items():
        assert rec.calls, name
        assert rec.varying_int_args() <= rec.unspecialised(), name


# ---- launch policy (pure functions) ------------------------------------------------------


def test_choose_config() -> None:
    c = cbgen_kernels.choose_config(32, 8, 128, max_query_len=1)
    assert (c.block_q, c.block_m, c.block_n, c.num_splits) == (1, 16, 64, 1)
    c = cbgen_kernels.choose_config(9, 3, 64, max_query_len=300)  # SmolLM2: group 3
    assert (c.block_q, c.block_m) == (21, 64)
    c = cbgen_kernels.choose_config(64, 1, 256, max_query_len=1)  # MQA, large head
    assert (c.block_q, c.block_m, c.block_n) == (1, 64, 32)
    with pytest.raises(ValueError, match="multiple"):
        cbgen_kernels.choose_config(6, 4, 64, 1)


def test_choose_num_splits() -> None:
    # enough programs already: no split
    assert cbgen_kernels.choose_num_splits(64, 8, 8192, num_sms=132) == 1
    # 2 sequences x 8 heads = 16 programs on 132 SMs wants ceil(264 / 16) = 17 -> cap 16
    assert cbgen_kernels.choose_num_splits(2, 8, 8192, num_sms=132) == 16
    # ... but a 1000-token context holds 3 splits of >= 256 keys
    assert cbgen_kernels.choose_num_splits(2, 8, 1000, num_sms=132) == 3
    # short contexts are never split
    assert cbgen_kernels.choose_num_splits(1, 1, 255, num_sms=132) == 1
    assert cbgen_kernels.choose_num_splits(1, 2, 4096, num_sms=8, max_splits=4) == 4


# ---- compiled for a real GPU, without one --------------------------------------------------


def _ptxas() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else shutil.which("ptxas")


@pytest.mark.skipif(_ptxas() is None, reason="triton ships no ptxas here")
def test_kernels_compile_for_hopper() -> None:
    """Triton lowers the kernels to sm_90 machine code on any machine (ptxas ships with
    triton): this catches what the interpreter cannot, such as compiled-dialect type errors or
    tiles that need too much shared memory. Runs in a fresh process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = (
        "from cbgen_kernels.compile_check import compile_all\n"
        "for v in compile_all(90, ('bf16',)): print(v.name, v.shared_bytes)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    names = [line.split()[0] for line in res.stdout.splitlines()]
    assert names == [
        "write_kv_cache[bf16]",
        "paged_attention[mixed,bf16]",
        "paged_attention[decode,bf16]",
        "paged_attention[decode-split,bf16]",
        "merge_splits[bf16]",
        "add_rmsnorm[h,bf16]",
        "add_rmsnorm[no-h,bf16]",
        "rope[bf16]",
        "rope_write_kv[bf16]",
        "silu_mul[bf16]",
        "grouped_moe[gate-up,bf16]",
        "grouped_moe[down,bf16]",
        "uniform_draws",
    ]


def test_rounding_fmas_leaves_out_the_adds_and_multiplies_sm80_writes_as_fmas() -> None:
    from cbgen_kernels.compile_check import rounding_fmas

    ptx = """
        mov.b16 \t%rs9, 0x3F80;
        mov.b16 \t%rs7, 0xBF80;
        mov.b16 \t%rs8, 0x8000;
        fma.rn.bf16 \t%rs1, %rs2, %rs9, %rs3;
        fma.rn.bf16 \t%rs1, %rs7, %rs2, %rs3;
        fma.rn.bf16 \t%rs4, %rs2, %rs5, %rs8;
        fma.rn.f32 \t%f1, %f2, 0f3F800000, %f4;
        fma.rn.f32 \t%f1, %f2, %f3, %f4;
        fma.rn.bf16 \t%rs4, %rs2, %rs5, %rs6;
    """
    assert rounding_fmas(ptx) == [
        "fma.rn.f32 \t%f1, %f2, %f3, %f4;",
        "fma.rn.bf16 \t%rs4, %rs2, %rs5, %rs6;",
    ]


@pytest.mark.skipif(_ptxas() is None, reason="triton ships no ptxas here")
def test_element_wise_kernels_compile_for_ampere_without_fused_rounding() -> None:
    """sm_80 has no bf16 add or multiply: LLVM writes them as fma with 1.0 or -0.0, which round
    like the plain operations and pass; the same kernels compiled with fp fusion on do get
    fused multiply-adds, which the check reports."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import cbgen_kernels.compile_check as C\n"
        "names = [v.name for v in C.compile_all(80, ('bf16',)) if v.name.startswith(C.ELEMENTWISE)]\n"
        "print(' '.join(names))\n"
        "fused = 0\n"
        "for name, fn, ptrs, consts in C.variants('fp32'):\n"
        "    if name.startswith('rope['):\n"
        "        src = ASTSource(fn=fn, signature=C._signature(fn, ptrs, consts), constexprs=consts)\n"
        "        opts = {'num_warps': 4, 'enable_fp_fusion': True}\n"
        "        c = triton.compile(src, target=GPUTarget('cuda', 80, 32), options=opts)\n"
        "        fused += len(C.rounding_fmas(c.asm['ptx']))\n"
        "print(fused)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    compiled, fused = res.stdout.split("\n")[:2]
    assert compiled.split() == [
        "add_rmsnorm[h,bf16]",
        "add_rmsnorm[no-h,bf16]",
        "rope[bf16]",
        "rope_write_kv[bf16]",
        "silu_mul[bf16]",
    ]
    assert int(fused) > 0


# ---- on a GPU only: sizes the interpreter cannot afford ----------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_long_prefill_and_split_decode() -> None:
    b = make_batch(
        [1000, 1, 1, 300], [0, 4000, 17, 2000], group=4, head_dim=128, dtype=torch.bfloat16, seed=10
    )
    args = (b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, b.scale)
    assert_close(cbgen_kernels.paged_attention(*args), reference(b), torch.bfloat16)
    d = make_batch([1, 1], [8000, 3000], group=8, head_dim=128, dtype=torch.bfloat16, seed=11)
    dargs = (d.query, d.kv_cache, d.block_table, d.query_start_loc, d.seq_lens, d.scale)
    assert_close(
        cbgen_kernels.paged_attention_split_kv(*dargs, num_splits=16), reference(d), torch.bfloat16
    )
