"""Attention backends: selection (with fakes for a missing flash / CUDA / triton), the cpu and
triton backends inside a full Engine on the CPU (triton under the Triton interpreter) against
the torch reference, the flash backend's call into a fake vllm_flash_attn, and the profiling
pass that sizes the KV cache on CUDA.

TRITON_INTERPRET=1 is set before triton is first imported (see tests/kernels/test_kernels.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cbgen.attention import (
    AttentionBackend,
    AttentionMetadata,
    flash_backend,
    select,
    torch_backend,
    triton_backend,
)
from cbgen.attention.select import get_attention_backend, resolve_backend_name
from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.profile import (
    build_profile_batch,
    cap_allocator,
    profile_peak_memory,
    profile_seq_lens,
    run_profile_forward,
)
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cpu" if select.triton_interpreted() else "cuda"
"""Where the triton backend runs in this process: on the CPU under the interpreter (switched on
above where there is no CUDA), else compiled on the GPU."""


# ---- selection ------------------------------------------------------------------------------


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pretend flash / triton are (not) importable and the kernels are (not) interpreted."""

    def set_world(flash: bool, triton: bool = True, interpreted: bool = True) -> None:
        monkeypatch.setattr(select, "flash_available", lambda: "vllm_flash_attn" if flash else None)
        monkeypatch.setattr(select, "triton_available", lambda: triton)
        monkeypatch.setattr(select, "triton_interpreted", lambda: interpreted)

    return set_world


def test_auto_on_the_cpu_is_cpu_whatever_is_installed(world: Callable[..., None]) -> None:
    world(flash=True, triton=True)
    assert resolve_backend_name("auto", CPU) == "cpu"
    assert resolve_backend_name("auto", CPU, torch.bfloat16, 16) == "cpu"


def test_auto_on_cuda_prefers_flash_then_triton_then_torch(world: Callable[..., None]) -> None:
    world(flash=True)
    assert resolve_backend_name("auto", CUDA) == "flash"
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 32) == "flash"
    # flash cannot take float32 or 8-token blocks: auto falls back to triton
    assert resolve_backend_name("auto", CUDA, torch.float32, 16) == "triton"
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 8) == "triton"
    world(flash=False)
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 16) == "triton"
    world(flash=False, triton=False)
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 16) == "torch"


def test_explicit_choices_that_cannot_run_say_why(world: Callable[..., None]) -> None:
    world(flash=True)
    with pytest.raises(ValueError, match="flash needs a CUDA device"):
        resolve_backend_name("flash", CPU)
    with pytest.raises(ValueError, match="float16 and bfloat16, not float32"):
        resolve_backend_name("flash", CUDA, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16, not 8"):
        resolve_backend_name("flash", CUDA, torch.bfloat16, 8)
    assert resolve_backend_name("flash", CUDA, torch.bfloat16, 16) == "flash"
    world(flash=False)
    with pytest.raises(ValueError, match="vllm_flash_attn"):
        resolve_backend_name("flash", CUDA)
    world(flash=False, triton=False)
    with pytest.raises(ValueError, match="triton is not installed"):
        resolve_backend_name("triton", CUDA)
    world(flash=False, triton=True, interpreted=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("triton", CPU)
    assert resolve_backend_name("triton", CUDA) == "triton"
    world(flash=False, triton=True, interpreted=True)
    assert resolve_backend_name("triton", CPU) == "triton"
    assert resolve_backend_name("torch", CUDA) == "torch"
    assert resolve_backend_name("torch", CPU) == "torch"
    assert resolve_backend_name("cpu", CPU) == "cpu"
    with pytest.raises(ValueError, match="cpu runs on the CPU, not cuda"):
        resolve_backend_name("cpu", CUDA)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend_name("xformers", CUDA)


def test_flash_available_probes_both_module_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("vllm_flash_attn", "vllm", "vllm.vllm_flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: import fails
    assert flash_backend.flash_available() is None
    fake = types.ModuleType("vllm.vllm_flash_attn")
    fake.flash_attn_varlen_func = lambda **kw: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fake)
    assert flash_backend.flash_available() == "vllm.vllm_flash_attn"
    no_func = types.ModuleType("vllm_flash_attn")
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", no_func)
    assert (
        flash_backend.flash_available() == "vllm.vllm_flash_attn"
    )  # the standalone one lacks the function


def test_triton_probes_see_a_missing_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_backend.triton_available()
    monkeypatch.setitem(sys.modules, "triton", None)
    assert not triton_backend.triton_available()


def test_get_attention_backend_builds_each_backend(world: Callable[..., None]) -> None:
    world(flash=False)
    assert get_attention_backend("torch", CPU).name == "torch"
    assert get_attention_backend("cpu", CPU).name == "cpu"
    assert get_attention_backend("auto", CPU).name == "cpu"
    assert get_attention_backend("triton", CPU).name == "triton"  # interpreter (this module)


# ---- flash backend against a fake vllm_flash_attn -----------------------------------------------


class FakeFlash:
    """flash_attn_varlen_func as vllm_flash_attn documents it (paged: k/v are the caches,
    seqused_k the key counts, causal aligned bottom-right; window_size (left, 0): query i sees
    keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q]; softcap 0.0: none),
    computed with the torch reference; records every call. The build without fa_version is an
    older one, without window_size and softcap too."""

    def __init__(self, with_fa_version: bool) -> None:
        self.calls: list[dict[str, Any]] = []
        self.module = types.ModuleType("vllm_flash_attn")
        if with_fa_version:

            def varlen(
                *,
                q,
                k,
                v,
                max_seqlen_q,
                cu_seqlens_q,
                max_seqlen_k,
                seqused_k=None,  # type: ignore[no-untyped-def]
                softmax_scale=None,
                causal=False,
                block_table=None,
                out=None,
                fa_version=2,
                window_size=None,
                softcap=0.0,
            ):
                return self.run(locals())

            self.module.is_fa_version_supported = lambda v: v == 3  # type: ignore[attr-defined]
        else:

            def varlen(
                *,
                q,
                k,
                v,
                max_seqlen_q,
                cu_seqlens_q,
                max_seqlen_k,
                seqused_k=None,  # type: ignore[no-untyped-def,misc]
                softmax_scale=None,
                causal=False,
                block_table=None,
                out=None,
            ):
                return self.run(locals())

        self.module.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]

    def run(self, kw: dict[str, Any]) -> torch.Tensor:
        self.calls.append(kw)
        assert kw["causal"] is True
        kv = torch.stack([kw["k"], kw["v"]])
        left, right = kw.get("window_size") or (-1, -1)
        assert right in (-1, 0)  # causal: nothing to the right either way
        res = torch_backend.paged_attention(
            kw["q"],
            kv,
            kw["block_table"],
            kw["cu_seqlens_q"],
            kw["seqused_k"],
            kw["softmax_scale"],
            sliding_window=left + 1 if left >= 0 else None,  # keys p - left .. p
            logit_softcap=kw.get("softcap") or None,
        )
        kw["out"].copy_(res)
        return kw["out"]


def _mixed_meta(
    block_size: int = 16,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode (context 20), a chunk of 6 after 10 cached tokens and a fresh 3-token prompt."""
    qlens, ctx = [1, 6, 3], [20, 10, 0]
    lens = [q + c for q, c in zip(qlens, ctx, strict=True)]
    table = torch.tensor([[3, 1, 0], [2, 5, 0], [4, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 7, 10], dtype=torch.int32)
    slots = []
    for i, (q, c) in enumerate(zip(qlens, ctx, strict=True)):
        for p in range(c, c + q):
            slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        max_query_len=6,
        max_seq_len=21,
        block_size=block_size,
    )
    g = torch.Generator().manual_seed(0)
    query = torch.randn(10, 8, 32, generator=g).to(torch.bfloat16)
    key = torch.randn(10, 2, 32, generator=g).to(torch.bfloat16)
    value = torch.randn(10, 2, 32, generator=g).to(torch.bfloat16)
    return meta, query, key, value


@pytest.mark.parametrize("with_fa_version", [True, False])
def test_flash_backend_one_call_for_the_mixed_batch_runs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, with_fa_version: bool
) -> None:
    from cbgen.attention.flash_backend import FlashAttentionBackend

    fake = FakeFlash(with_fa_version)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", fake.module)
    be = FlashAttentionBackend()
    assert be.fa_version == (3 if with_fa_version else None)
    meta, query, key, value = _mixed_meta()
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 16, 2, 32, generator=g).to(torch.bfloat16)
    want_cache = cache.clone()
    torch_backend.write_kv_cache(key, value, want_cache, meta.slot_mapping)
    want = torch_backend.paged_attention(
        query, want_cache, meta.block_table, meta.query_start_loc, meta.seq_lens, 0.2
    )
    be.prepare(meta)
    got = be.forward(query, key, value, cache, meta, 0.2)
    assert len(fake.calls) == 1
    call = fake.calls[0]
    assert call["cu_seqlens_q"] is meta.query_start_loc and call["seqused_k"] is meta.seq_lens
    assert call["block_table"] is meta.block_table
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["softmax_scale"]) == (6, 21, 0.2)
    assert call["k"].shape == (6, 16, 2, 32) and call["k"].data_ptr() == cache[0].data_ptr()
    assert ("fa_version" in call and call["fa_version"] == 3) == with_fa_version
    assert torch.equal(cache, want_cache)  # the new K/V went in by slot_mapping
    assert torch.equal(got, want)


def test_flash_backend_passes_the_window_and_the_cap_runs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cbgen.attention.flash_backend import FlashAttentionBackend

    fake = FakeFlash(True)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", fake.module)
    be = FlashAttentionBackend()
    assert be.unsupported(True, True) is None
    meta, query, key, value = _mixed_meta()
    cache = torch.randn(2, 6, 16, 2, 32, generator=torch.Generator().manual_seed(1))
    cache = cache.to(torch.bfloat16)
    want_cache = cache.clone()
    torch_backend.write_kv_cache(key, value, want_cache, meta.slot_mapping)
    want = torch_backend.paged_attention(
        query,
        want_cache,
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        0.2,
        sliding_window=7,
        logit_softcap=3.0,
    )
    be.prepare(meta)
    got = be.forward(query, key, value, cache, meta, 0.2, sliding_window=7, logit_softcap=3.0)
    call = fake.calls[0]
    assert call["window_size"] == (6, 0) and call["softcap"] == 3.0
    assert torch.equal(got, want)
    plain = be.forward(query, key, value, cache, meta, 0.2)
    assert fake.calls[1]["window_size"] is None and fake.calls[1]["softcap"] == 0.0  # defaults
    assert not torch.equal(plain, got)
    # an older build without the arguments is refused for a model that needs them
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", FakeFlash(False).module)
    old = FlashAttentionBackend()
    assert old.unsupported(False, False) is None
    assert "takes no window_size or softcap" in (old.unsupported(True, True) or "")
    with pytest.raises(ValueError, match="takes no softcap, which the model needs"):
        old.forward(query, key, value, cache, meta, 0.2, logit_softcap=3.0)


def test_flash_backend_refuses_what_its_kernels_cannot_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cbgen.attention.flash_backend import FlashAttentionBackend

    monkeypatch.setitem(sys.modules, "vllm_flash_attn", FakeFlash(True).module)
    be = FlashAttentionBackend()
    meta, query, key, value = _mixed_meta(block_size=16)
    be.prepare(meta)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        be.forward(
            query.float(), key.float(), value.float(), torch.zeros(2, 6, 16, 2, 32), meta, 0.2
        )
    meta8, *_ = _mixed_meta(block_size=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        be.prepare(meta8)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match="vllm_flash_attn"):
        FlashAttentionBackend()


# ---- the cpu backend against the torch reference ------------------------------------------------


def _run_backend(be: AttentionBackend, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """prepare + forward of one backend on the mixed batch: (its output, the cache after)."""
    meta, query, key, value = _mixed_meta()
    cache = torch.randn(2, 6, 16, 2, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    be.prepare(meta)
    out = be.forward(query.to(dtype), key.to(dtype), value.to(dtype), cache, meta, 0.2)
    return out, cache


@pytest.mark.parametrize("with_kernels", [True, False])
def test_cpu_backend_matches_the_torch_reference(
    with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode, a chunk after cached context and a fresh prompt: float32 through the C kernels
    (or, without them, the torch path, to the bit); bfloat16, which the kernels do not take,
    through the torch path either way."""
    from cbgen.attention.cpu_backend import CpuAttentionBackend
    from cbgen.cpu import build, kernels

    if not with_kernels:
        monkeypatch.setattr(build, "load_library", lambda: None)
    elif build.load_library() is None:
        pytest.skip("no C compiler: no kernels")
    answered = []
    decode = kernels.paged_decode_f32
    monkeypatch.setattr(
        kernels, "paged_decode_f32", lambda *a: answered.append(o := decode(*a)) or o
    )
    for dtype in (torch.float32, torch.bfloat16):
        want, want_cache = _run_backend(torch_backend.TorchAttentionBackend(), dtype)
        answered.clear()
        got, got_cache = _run_backend(CpuAttentionBackend(), dtype)
        assert torch.equal(got_cache, want_cache)
        if with_kernels and dtype == torch.float32:
            # every token (the small chunks too) in one call of the decode kernel
            assert (
                len(answered) == 1 and answered[0] is not None and answered[0].shape == (10, 8, 32)
            )
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert all(o is None for o in answered)
            assert torch.equal(got, want)


def test_cpu_backend_refuses_tensors_off_the_cpu() -> None:
    from cbgen.attention.cpu_backend import CpuAttentionBackend

    meta, *_ = _mixed_meta()
    meta.block_table = meta.block_table.to("meta")
    with pytest.raises(ValueError, match="cpu runs on the CPU, not meta"):
        CpuAttentionBackend().prepare(meta)


# ---- the triton backend in a full engine (CPU: Triton interpreter) -----------------------------

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [
        100,
        3,
        77,
        42,
        42,
        9,
        250,
        17,
        33,
        61,
        12,
        8,
        190,
        4,
        4,
        4,
        61,
        99,
        23,
        14,
        15,
        16,
        17,
        18,
        19,
    ],
    [200, 201, 202, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79],
]
NEW_TOKENS = 6


def _greedy(engine: Engine) -> list[list[int]]:
    outs = LLM(engine=engine).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_engine_greedy_matches_the_torch_reference(
    name: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Same weights (tiny Llama, GQA 4:2), same prompts, chunked prefill (chunks of 8 tokens
    over cached context) and 4-token blocks (many block crossings): the cpu backend (its C
    kernels, or the torch path where there is no compiler) and the triton backend under the
    interpreter (or compiled, where there is CUDA) give the torch reference's greedy tokens."""
    cfg = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device=TRITON_DEVICE if name == "triton" else "cpu",
        dtype="float32",
        kv_cache_memory=4 << 20,
        block_size=4,
        max_num_batched_tokens=8,
        attention_backend="torch",
    )
    torch_engine = Engine(cfg)
    want = _greedy(torch_engine)
    engine = Engine(cfg.replace(attention_backend=name), share_weights_with=torch_engine)
    assert engine.backend.name == name
    assert _greedy(engine) == want


def test_triton_engine_split_kv_decodes_match_torch(tiny_model_dir: Callable[[str], Path]) -> None:
    """Decode steps forced onto the split-KV path (an imaginary 64-SM GPU, >= 8 keys a split,
    at most 3 splits) still give the torch backend's greedy tokens."""
    from cbgen.attention.triton_backend import TritonAttentionBackend

    cfg = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device=TRITON_DEVICE,
        dtype="float32",
        kv_cache_memory=4 << 20,
        block_size=16,
        attention_backend="torch",
    )
    torch_engine = Engine(cfg)
    want = _greedy(torch_engine)
    # eager: graphs captured before the backend is swapped would replay the old one (CUDA)
    engine = Engine(
        cfg.replace(attention_backend="triton", enforce_eager=True), share_weights_with=torch_engine
    )
    split = TritonAttentionBackend(num_sms=64, min_keys_per_split=8, max_splits=3)
    engine.backend = engine.runner.backend = split
    seen: list[int] = []
    original = split.attend

    def spy(*args: Any, **options: Any) -> torch.Tensor:
        # every layer attends through attend: forward calls it after writing K/V, and layers
        # whose ops wrote K/V already (TritonOps' fused RoPE + write, on CUDA) call it alone
        out = original(*args, **options)
        seen.append(args[2].state.num_splits)
        return out

    split.attend = spy  # type: ignore[method-assign]
    assert _greedy(engine) == want
    assert max(seen) == 3 and min(seen) == 1  # prefill steps unsplit, decodes of >= 24 keys split


# ---- profiling (sizing the KV cache on CUDA) -------------------------------------------------


def test_profile_seq_lens() -> None:
    assert profile_seq_lens(2048, 256, 4096) == [1793] + [1] * 255
    assert profile_seq_lens(2048, 4, 512) == [512, 512, 512, 512]  # capped by max_model_len
    assert profile_seq_lens(10, 64, 100) == [1] * 10  # no more sequences than tokens
    assert profile_seq_lens(100, 3, 40) == [40, 40, 20]


def test_build_profile_batch_slots_and_blocks() -> None:
    b = build_profile_batch([5, 1, 3], block_size=4, device=CPU)
    # blocks: seq 0 -> 0, 1; seq 1 -> 2; seq 2 -> 3
    assert b.num_blocks == 4
    assert b.meta.block_table.tolist() == [[0, 1], [2, 0], [3, 0]]
    assert b.meta.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2]
    assert b.meta.query_start_loc.tolist() == [0, 5, 6, 9]
    assert b.meta.seq_lens.tolist() == [5, 1, 3]
    assert (b.meta.max_query_len, b.meta.max_seq_len) == (5, 5)
    assert b.logits_indices.tolist() == [4, 5, 8]
    assert len(set(b.meta.slot_mapping.tolist())) == 9


def test_profile_forward_runs_the_full_budget_on_cpu(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            kv_cache_memory=1 << 20,
            max_num_batched_tokens=100,
            max_num_seqs=7,
        )
    )
    args = (
        engine.model,
        engine.backend,
        engine.config,
        engine.max_model_len,
        engine.dtype,
        engine.device,
    )
    probs, kv_bytes = run_profile_forward(*args)
    assert probs.shape == (7, engine.model_config.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(7))
    # 94-token chunk + 6 one-token prompts in 16-token blocks: 6 + 6 blocks
    assert kv_bytes == 12 * engine.kv_bytes_per_block
    with pytest.raises(ValueError, match="needs a CUDA device"):
        profile_peak_memory(*args)


# ---- on a GPU only ---------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["triton", "flash"])
def test_cuda_engine_greedy_matches_torch(name: str, tiny_model_dir: Callable[[str], Path]) -> None:
    """float32 for exact greedy agreement (triton, ieee dots); bfloat16 for flash, which takes
    no float32, compared against the torch backend in bfloat16."""
    if name == "flash" and flash_backend.flash_available() is None:
        pytest.skip("vllm_flash_attn does not import here")
    dtype = "float32" if name == "triton" else "bfloat16"
    cfg = EngineConfig(
        model=str(tiny_model_dir("llama")),
        device="cuda",
        dtype=dtype,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=8,
        attention_backend="torch",
    )
    torch_engine = Engine(cfg)
    want = _greedy(torch_engine)
    got = _greedy(Engine(cfg.replace(attention_backend=name), share_weights_with=torch_engine))
    assert got == want


@pytest.mark.cuda
@cuda
def test_cuda_flash_backend_matches_reference() -> None:
    if flash_backend.flash_available() is None:
        pytest.skip("vllm_flash_attn does not import here")
    from cbgen.attention.flash_backend import FlashAttentionBackend

    meta, query, key, value = _mixed_meta()
    meta = AttentionMetadata(
        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    )
    cache = torch.randn(2, 6, 16, 2, 32, dtype=torch.bfloat16, device="cuda")
    want_cache = cache.clone()
    torch_backend.write_kv_cache(key.cuda(), value.cuda(), want_cache, meta.slot_mapping)
    want = torch_backend.paged_attention(
        query.cuda().float(),
        want_cache.float(),
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        0.2,
    )
    be = FlashAttentionBackend()
    be.prepare(meta)
    got = be.forward(query.cuda(), key.cuda(), value.cuda(), cache, meta, 0.2)
    assert (got.float() - want).abs().max().item() <= 3e-2


@pytest.mark.cuda
@cuda
def test_cuda_profile_sizes_the_kv_cache() -> None:
    """bf16 by default; the KV cache gets what gpu_memory_utilization leaves after weights and
    the activations of a full-budget step (a few GiB at most for a 1B model)."""
    engine = Engine(
        EngineConfig(
            model="llama-1b",
            load_format="dummy",
            device="cuda",
            max_model_len=4096,
            gpu_memory_utilization=0.5,
        )
    )
    assert engine.dtype == torch.bfloat16
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = engine.num_blocks * engine.kv_bytes_per_block
    budget = 0.5 * torch.cuda.get_device_properties(0).total_memory
    assert weights + kv < budget
    # the profile counts memory outside torch (this CUDA context, other processes': xdist
    # workers hold one each): what it leaves is the budget less weights, activations and that
    free, total = torch.cuda.mem_get_info(0)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(0))
    assert kv > budget - weights - outside - (4 << 30)
    assert f"{engine.num_blocks} blocks" in engine.describe()


def test_the_allocator_cap_names_the_device_as_torch_requires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.cuda.set_per_process_memory_fraction takes an index, not a bare "cuda" (found on
    an H200: the engine passed its device and every profiled start-up raised). The cap is the
    budget less the memory outside torch, never below what torch holds already."""
    from torch.cuda._utils import _get_device_index

    calls: list[tuple[float, int]] = []

    def set_fraction(fraction: float, device: Any) -> None:
        calls.append((fraction, _get_device_index(device)))  # raises as torch's own does

    props = type("Props", (), {"total_memory": 100 << 30})()
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cap_allocator(torch.device("cuda"), 50 << 30, 40 << 30, 1 << 30) == 0.49
    assert cap_allocator(torch.device("cuda:1"), 50 << 30, 45 << 30, 10 << 30) == 0.45
    assert calls == [(0.49, 0), (0.45, 1)]


def test_profile_batch_covers_the_whole_token_budget() -> None:
    lens = profile_seq_lens(2048, 256, 131072)
    assert sum(lens) == 2048 and len(lens) == 256
    b = build_profile_batch(lens, 16, CPU)
    assert b.input_ids.shape == (2048,)
    assert b.num_blocks == -(-1793 // 16) + 255
    slots = b.meta.slot_mapping.numpy()
    assert len(np.unique(slots)) == 2048 and slots.max() < b.num_blocks * 16
