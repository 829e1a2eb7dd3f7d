"""Sliding windows and logit soft-capping.

- where transformers applies a window, per layer (Mistral: every layer; Qwen2/3: from
  max_window_layers on, or as layer_types says);
- every attention backend against a direct torch computation of the rule (a query at p sees keys
  p - W < j <= p; scores s become c * tanh(s / c) before the mask), on a mixed batch whose blocks
  wholly before each window hold NaN, so that a backend reading them (even masked) fails;
- whole engines token-for-token against transformers (eager attention, float32, greedy) past
  the window, with chunked prefill and prefix caching: a tiny Mistral (window 16) and a tiny
  Qwen2 whose upper layers alone are windowed;
- the KV blocks behind every layer's window going back to the pool: a long generation in a
  cache too small for all of it, random scheduler workloads (the scheduler tests' fake model)
  reading every window position from blocks they hold, and the prefix cache never recording a
  released block under a prefix it no longer holds.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import pytest
from helpers.models import save_random
from helpers.scheduling import FakeRunner, default_token, make_request, prefix_ids, workloads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbgen.attention import AttentionBackend, AttentionMetadata, select
from cbgen.attention.cpu_backend import CpuAttentionBackend
from cbgen.attention.torch_backend import TorchAttentionBackend
from cbgen.attention.triton_backend import TritonAttentionBackend, TritonPlan
from cbgen.cpu import build, kernels, thresholds
from cbgen.engine.engine import Engine
from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.scheduler import Scheduler, SchedulerOutput
from cbgen.llm import LLM
from cbgen.models.config import ModelConfig
from cbgen.sampling_params import SamplingParams

WINDOW = 16


# ---- configuration ------------------------------------------------------------------------------


def test_where_transformers_applies_a_window() -> None:
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        vocab_size=256, sliding_window=32,
    )  # fmt: skip

    def windows(model_type: str, **extra: Any) -> tuple[int | None, ...]:
        return ModelConfig.from_hf_dict(dict(base, model_type=model_type, **extra)).layer_windows

    assert windows("mistral") == (32,) * 4
    assert windows("mistral", layer_types=["full_attention"] * 4) == (32,) * 4  # ignored there
    assert windows("llama") == (None,) * 4  # Llama ignores the key
    assert windows("qwen2", use_sliding_window=False, max_window_layers=1) == (None,) * 4
    assert windows("qwen2", use_sliding_window=True, max_window_layers=4) == (None,) * 4
    assert windows("qwen2", use_sliding_window=True, max_window_layers=1) == (None, 32, 32, 32)
    assert windows("qwen3", use_sliding_window=True, max_window_layers=0) == (32,) * 4
    types = ["sliding_attention", "full_attention"] * 2
    assert windows("qwen2", use_sliding_window=True, max_window_layers=2, layer_types=types) == (
        32, None, 32, None,
    )  # fmt: skip
    with pytest.raises(ValueError, match="'layer_types' must name"):
        windows("qwen2", use_sliding_window=True, max_window_layers=2, layer_types=types[:3])


# ---- backends against the rule, computed directly ------------------------------------------------

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 64
SEQS = [(37, 1), (9, 1), (30, 7), (0, 11), (150, 20), (21, 5), (90, 1), (3, 1)]
"""(cached context, new query tokens) of each sequence of the mixed batch."""


def _batch() -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixed batch over a shuffled paged cache (block 0 left unused, all zeros): metadata,
    query, new key and value, and the cache with every context key written."""
    g = torch.Generator().manual_seed(0)
    lens = [c + q for c, q in SEQS]
    need = [-(-n // BLOCK) for n in lens]
    ids = (torch.randperm(sum(need), generator=g) + 1).tolist()
    table = torch.zeros(len(SEQS), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[at : at + n])
        at += n
    cache = torch.zeros(2, sum(need) + 1, BLOCK, KV_HEADS, DIM)
    slots = []
    for i, (ctx, q) in enumerate(SEQS):
        for p in range(ctx + q):
            slot = int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
            if p < ctx:
                cache.view(2, -1, KV_HEADS, DIM)[:, slot] = torch.randn(
                    2, KV_HEADS, DIM, generator=g
                )
            else:
                slots.append(slot)
    total = sum(q for _, q in SEQS)
    qsl = torch.tensor([0] + [q for _, q in SEQS]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        max_query_len=max(q for _, q in SEQS),
        max_seq_len=max(lens),
        block_size=BLOCK,
    )
    query = torch.randn(total, HEADS, DIM, generator=g) * 2
    key = torch.randn(total, KV_HEADS, DIM, generator=g) * 2
    value = torch.randn(total, KV_HEADS, DIM, generator=g)
    return meta, query, key, value, cache


def _direct(
    query: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The rule, one query at a time: keys p - W < j <= p, scores capped before the softmax."""
    out = torch.empty_like(query)
    group = HEADS // KV_HEADS
    for i, (ctx, q) in enumerate(SEQS):
        start = int(meta.query_start_loc[i])
        for t in range(q):
            p = ctx + t
            first = 0 if window is None else max(0, p - window + 1)
            slots = [
                int(meta.block_table[i, j // BLOCK]) * BLOCK + j % BLOCK
                for j in range(first, p + 1)
            ]
            k = cache[0].reshape(-1, KV_HEADS, DIM)[slots].double()
            v = cache[1].reshape(-1, KV_HEADS, DIM)[slots].double()
            for h in range(HEADS):
                s = (k[:, h // group] @ query[start + t, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                out[start + t, h] = (s.softmax(0) @ v[:, h // group]).float()
    return out


def _poison_outside(cache: torch.Tensor, meta: AttentionMetadata, window: int) -> None:
    """NaN in every block wholly before the first key the sequence's first query sees."""
    for i, (ctx, _) in enumerate(SEQS):
        first_key = max(0, ctx - window + 1)
        for b in range(first_key // BLOCK):
            cache[:, int(meta.block_table[i, b])] = float("nan")


BACKENDS = ["torch", "cpu-decode-kernel", "cpu-prefill-kernel", "triton", "triton-split-kv"]


def _backend(name: str, monkeypatch: pytest.MonkeyPatch) -> AttentionBackend:
    """The backend; the cpu one with each of its C kernels made to answer (counted); triton
    (on the CPU under the Triton interpreter) plain or with its keys split in three ranges."""
    if name == "torch":
        return TorchAttentionBackend()
    if name.startswith("triton"):
        if not select.triton_interpreted() and not torch.cuda.is_available():
            pytest.skip("triton needs CUDA or its interpreter")
        if name == "triton":
            return TritonAttentionBackend()
        return _SplitEveryStep(num_sms=64, min_keys_per_split=8, max_splits=3)
    if build.load_library() is None:
        pytest.skip(build.native_status())
    # every chunk to the decode kernel, or every chunk to the prefill kernel
    # (the decode kernel takes prompt chunks only where a build prefers SDPA to the prefill one)
    rows = 1 << 30 if name == "cpu-decode-kernel" else 0
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (rows, name != "cpu-decode-kernel"))
    kernel = "paged_decode_f32" if name == "cpu-decode-kernel" else "prefill_attention_f32"
    original = getattr(kernels, kernel)

    def counted(*args: Any) -> torch.Tensor | None:
        out = original(*args)
        assert out is not None
        KERNEL_CALLS.append(kernel)
        return out

    monkeypatch.setattr(kernels, kernel, counted)
    return CpuAttentionBackend()


KERNEL_CALLS: list[str] = []


class _SplitEveryStep(TritonAttentionBackend):
    """Split-KV on mixed batches too (the kernel is correct for any batch)."""

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.state = TritonPlan(decode_only=True)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    ("window", "softcap"), [(5, None), (8, None), (None, 1.5), (6, 2.0), (64, None)]
)
def test_backend_applies_the_window_and_the_cap(
    name: str, window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    KERNEL_CALLS.clear()
    backend = _backend(name, monkeypatch)
    assert backend.unsupported(window is not None, softcap is not None) is None
    meta, query, key, value, cache = _batch()
    if window is not None:
        _poison_outside(cache, meta, window)
    backend.prepare(meta)
    out = backend.forward(
        query, key, value, cache, meta, 0.3, sliding_window=window, logit_softcap=softcap
    )
    assert not out.isnan().any()
    want = _direct(query, cache, meta, 0.3, window, softcap)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if name.startswith("cpu"):  # the kernel did the work, not the torch path beside it
        assert KERNEL_CALLS
    # and the same batch without the options is the plain causal attention
    if window is None:
        meta, query, key, value, cache = _batch()
        backend.prepare(meta)
        plain = backend.forward(query, key, value, cache, meta, 0.3)
        torch.testing.assert_close(plain, _direct(query, cache, meta, 0.3, None, None))
        assert not torch.allclose(plain, out)


# ---- whole engines against transformers ------------------------------------------------------------


SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SHAPE)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_random(model, tmp_path_factory.mktemp("mistral"), seed=0)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=12, max_window_layers=1,
        **SHAPE,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return save_random(model, tmp_path_factory.mktemp("qwen2"), seed=0)


PROMPTS = [
    list(range(30, 53)),  # 23 tokens
    [5, 9, 33, 7, 100, 4, 8, 8, 61, 12] * 4 + [17, 250],  # 42
    [5, 9, 33, 7, 100, 4, 8, 8, 61, 12] * 4 + [3, 90, 11, 6, 6, 201, 44],  # same first 40
    [200, 3, 3, 17, 250, 11, 8, 90, 61, 12] * 5 + [7, 7, 7, 77, 70, 71, 72],  # 57
]


_HF_TOKENS: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}
"""transformers' greedy tokens by (checkpoint, prompt, count): each backend's test asks again."""


def _transformers_tokens(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    keys = [(folder, tuple(p), n) for p in prompts]
    if all(k in _HF_TOKENS for k in keys):
        return [_HF_TOKENS[k] for k in keys]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    hf.generation_config.eos_token_id = None  # as ignore_eos: go on past EOS, unmasked
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        full = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        out.append(full[0, len(prompt) :].tolist())
    _HF_TOKENS.update(zip(keys, out, strict=True))
    return out


def _cbgen_tokens(folder: Path, backend: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    if backend == "triton" and not select.triton_interpreted():
        pytest.skip("triton runs on the CPU only under its interpreter")
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", kv_cache_memory=4 << 20, num_threads=1,
        attention_backend=backend, block_size=4, max_num_batched_tokens=24, max_num_seqs=3,
        enable_prefix_caching=True,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = LLM(engine=engine).generate(prompts, params)
    assert engine.kv.num_hits > 0  # the shared and the repeated prompts hit the cache
    return [o.output_token_ids for o in outs]


ENGINE_BACKENDS = ["torch", "cpu", "triton"]


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_mistral_past_the_window_matches_transformers(mistral: Path, backend: str) -> None:
    prompts = [*PROMPTS, PROMPTS[1]]  # the repeat is served from the prefix cache
    n = 8 if backend == "triton" else 20  # (the interpreter is slow; every prompt is past 16)
    got = _cbgen_tokens(mistral, backend, prompts, n)
    assert got == _transformers_tokens(mistral, prompts, n)


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_qwen2_with_windowed_upper_layers_matches_transformers(qwen2: Path, backend: str) -> None:
    assert ModelConfig.from_json(qwen2 / "config.json").layer_windows == (None, 12, 12)
    n = 8 if backend == "triton" else 16
    got = _cbgen_tokens(qwen2, backend, PROMPTS, n)
    assert got == _transformers_tokens(qwen2, PROMPTS, n)


def test_auto_passes_over_a_flash_build_without_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    if not select.triton_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton needs CUDA or its interpreter")

    class OldFlash(TorchAttentionBackend):
        name = "flash"

        def unsupported(self, sliding_window: bool, logit_softcap: bool) -> str | None:
            return "flash: this build takes no window_size" if sliding_window else None

    monkeypatch.setattr(select, "resolve_backend_name", lambda *args: "flash")
    monkeypatch.setattr(select, "FlashAttentionBackend", OldFlash)
    monkeypatch.setattr(select, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    assert select.get_attention_backend("auto", cuda).name == "flash"
    assert select.get_attention_backend("auto", cuda, sliding_window=True).name == "triton"
    with pytest.raises(ValueError, match="attention_backend: flash: this build takes no window"):
        select.get_attention_backend("flash", cuda, sliding_window=True)


def test_a_backend_that_cannot_apply_the_window_is_refused(
    mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        TorchAttentionBackend, "unsupported", lambda self, window, cap: "no windows here"
    )
    with pytest.raises(ValueError, match="attention_backend: no windows here"):
        Engine(model=str(mistral), device="cpu", dtype="float32", attention_backend="torch")


# ---- blocks out of every window go back -----------------------------------------------------------


def test_a_long_generation_holds_a_bounded_number_of_blocks(mistral: Path) -> None:
    """16 KV blocks of 4 tokens: a 23-token prompt plus 150 generated tokens (44 blocks' worth)
    fits only because the blocks behind the window are released, and the tokens are still
    transformers'."""
    engine = Engine(
        model=str(mistral), device="cpu", dtype="float32", num_threads=1, block_size=4,
        kv_cache_memory=16 * 2 * 2 * 4 * 2 * 16 * 4,  # blocks x K,V x layers x slots x heads x dim x 4 B
        max_num_batched_tokens=8, enable_prefix_caching=True,
    )  # fmt: skip
    assert engine.num_blocks == 16 and engine.kv.sliding_window == WINDOW
    held: list[int] = []
    schedule = engine.scheduler.schedule

    def watched(now: float) -> Any:
        out = schedule(now)
        held.append(engine.kv.num_used_blocks)
        return out

    engine.scheduler.schedule = watched  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    (out,) = LLM(engine=engine).generate([PROMPTS[0]], params)
    assert out.output_token_ids == _transformers_tokens(mistral, [PROMPTS[0]], 150)[0]
    # the window (16 keys) and a chunk of 8 span at most 7 blocks of 4
    assert max(held) <= engine.kv.max_blocks_held(173, 8) == 7
    assert engine.kv.num_used_blocks == 0


def test_mixed_full_and_windowed_layers_release_nothing(qwen2: Path) -> None:
    engine = Engine(model=str(qwen2), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    assert engine.kv.sliding_window is None
    assert engine.kv.max_blocks_held(173, 8) == engine.kv.blocks_needed(173)


def _request(rid: str, tokens: list[int]) -> Any:
    from cbgen.engine.request import Request

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return Request(rid, tokens, params, arrival_time=0.0)


def test_released_and_skipped_blocks_never_enter_the_cache_under_another_prefix() -> None:
    """Cache hits before the first query's window are placed, not taken; the pool may hand them
    out again at once, and registering the request's blocks must not record them under the
    prefix they no longer hold."""
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    prompt = list(range(100, 140))  # 10 blocks
    a = _request("a", prompt)
    assert kv.allocate_slots(a, 40) is not None
    kv.cache_blocks(a, 40)
    a.num_computed_tokens = 40
    assert kv.free_out_of_window(a) == 8  # keys 35.. are in the next query's window
    assert kv.num_used_blocks == 2
    kv.free(a)
    assert kv.num_used_blocks == 0
    # b: the same 40 tokens and 8 more: 10 hits, of which the 8 wholly before the first query's
    # window (from 40 - 6 + 1 on) are placed but not taken
    b = _request("b", prompt + list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 40
    new = kv.allocate_slots(b, 8, hits)
    hit_ids = [blk.block_id for blk in hits]
    assert new is not None and new[:10] == hit_ids
    assert kv.req_num_dropped["b"] == 8 and [blk.ref_cnt for blk in hits[8:]] == [1, 1]
    assert set(new[10:]) <= set(hit_ids[:8])  # the pool handed skipped hits straight back
    assert [blk.ref_cnt for blk in hits[:8]] == [int(i in new[10:]) for i in hit_ids[:8]]
    b.num_computed_tokens = 40
    kv.cache_blocks(b, 48)
    # every cached block holds what its hash says: no block b writes is cached under the tokens
    # of a position it was skipped at
    table = kv.block_ids("b")
    live = {bid: i for i, bid in enumerate(table) if i >= 8}
    tokens = b.all_token_ids
    for block_id in kv.pool.cached.values():
        block = kv.pool.blocks[block_id]
        if block_id in live:
            i = live[block_id]
            assert block.token_ids == tuple(tokens[i * 4 : (i + 1) * 4])
    kv.free(b)
    assert kv.num_used_blocks == 0 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


class WindowRunner(FakeRunner):
    """The scheduler tests' fake runner under a window: it records which prefix each KV slot
    holds, writes a step's new K/V first (as every backend does, layer by layer), then checks
    that every query reads the right prefix at every position of its window, from blocks its
    request still holds (so that nobody else can overwrite them)."""

    def __init__(self, sched: Scheduler, window: int) -> None:
        super().__init__(sched)
        self.window = window
        self.num_reads = 0

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.begin(out)
        prefixes = {}
        for s in out.scheduled:
            rid = s.request_id
            if s.new_token_ids is not None:
                self.tokens[rid], self.tables[rid] = list(s.new_token_ids), []
            self.tables[rid].extend(s.new_block_ids)
            assert self.tables[rid] == self.sched.kv.block_ids(rid)
            end = s.num_computed_tokens + s.num_new_tokens
            prefixes[rid] = prefix = prefix_ids(self.tokens[rid][:end])
            for pos in range(s.num_computed_tokens, end):
                self.slots[self.slot(rid, pos)] = prefix[pos]
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            rid, prefix = s.request_id, prefixes[s.request_id]
            held_from = self.sched.kv.req_num_dropped.get(rid, 0) * self.bs
            for pos in range(max(0, s.num_computed_tokens - self.window + 1), len(prefix)):
                assert pos >= held_from, (rid, pos, "read from a released block")
                assert self.slots.get(self.slot(rid, pos)) == prefix[pos], (rid, pos)
                self.num_reads += 1
            if s.will_sample:
                tokens = self.tokens[rid]
                token = default_token(rid, len(tokens) - self.sched.requests[rid].num_prompt_tokens)
                tokens.append(token)
                sampled[rid] = token
        return sampled


def _check_ref_counts(kv: KVCacheManager) -> None:
    """A block's count is the number of requests holding it (released entries do not)."""
    holders: dict[int, int] = {}
    for rid, blocks in kv.req_blocks.items():
        for b in blocks[kv.req_num_dropped.get(rid, 0) :]:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.block_id in kv.pool.free_queue) == (block.ref_cnt == 0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 20))
def test_random_workloads_under_a_window_read_only_what_they_hold(
    work: tuple[dict[str, Any], list[tuple[int, int, int]]], window: int
) -> None:
    """The scheduler tests' random workloads (shared prefixes, whole repeats, tight caches,
    preemptions, chunking on and off, caching on and off) with blocks released behind a window:
    every window position reads its own prefix's K/V from a block its request holds, and the
    outputs are the fake model's."""
    cfg, specs = work
    kv = KVCacheManager(
        cfg["num_blocks"], cfg["block_size"], enable_caching=cfg["caching"], sliding_window=window
    )
    sched = Scheduler(kv, cfg["max_num_seqs"], cfg["max_num_batched_tokens"], cfg["chunked"])
    runner = WindowRunner(sched, window)
    prefixes = [[900 + 3 * j + i % 3 for i in range(24)] for j in range(3)]
    reqs = []
    for i, (plen, max_tokens, group) in enumerate(specs):
        if group == 3:
            prompt = list(range(500, 500 + plen))
        else:
            prompt = [*(prefixes[group] + [i] * 40)[: plen - 1], 10000 + i]
        reqs.append(make_request(f"r{i}", prompt, max_tokens))
        sched.add_request(reqs[-1])
    for step in range(10_000):
        if not sched.has_unfinished():
            break
        out = sched.schedule(now=float(step))
        _check_ref_counts(kv)
        sched.update_from_output(out, runner.execute(out), now=float(step))
    assert not sched.has_unfinished() and kv.num_free_blocks == kv.num_blocks
    for r in reqs:
        assert r.output_token_ids == [
            default_token(r.request_id, j) for j in range(r.sampling_params.max_tokens)
        ]
