"""Prefix caching end to end: greedy output with caching on equals caching off, token for
token, and the cached-token counts are exactly the shared full blocks plus the partial hits
(the first tokens of a block cached in an earlier step after the same block).

Tiny random-weight models (block size 4) for the exact cases; SmolLM2 once, marked slow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import RequestOutput
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

SHARED = [
    17,
    3,
    99,
    42,
    250,
    8,
    61,
    77,
    190,
    12,
    5,
    33,
    201,
    14,
    90,
    6,
    123,
    45,
    2,
    71,
    88,
    19,
    64,
]  # 23 tokens: 5 full blocks + 3
PROMPTS = [
    [*SHARED, 11, 12, 13, 14, 15, 16],
    [*SHARED, 21, 22],
    [*SHARED[:6], 31, 32, 33, 34, 35, 36, 37],  # shares one full block and half of the next
    [*SHARED[:6], 31, 32, 33, 34, 35, 36, 37],  # a repeat: all but the block holding its last token
    SHARED[:20],  # exactly 5 full blocks of another prompt: the last one is recomputed
    [240, 241, 242, 243, 244, 245, 246, 247, 248],  # nothing shared
    SHARED + [11, 12, 13, 14, 15, 16] + [7] * 9,  # extends the first prompt
]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(prompt: Sequence[int], cached_tokens: Sequence[int]) -> int:
    """Full blocks shared with a sequence whose KV is cached, capped below the last token."""
    return min(common_prefix(prompt, cached_tokens) // BS, (len(prompt) - 1) // BS) * BS


@pytest.fixture(scope="module")
def base(tiny_model_dir: Callable[[str], Path]) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            dtype="float32",
            kv_cache_memory=4 << 20,
            block_size=BS,
            num_threads=1,  # two test workers share two cores
        )
    )


def run(
    base: Engine, batches: Sequence[Sequence[Sequence[int]]], **overrides: Any
) -> tuple[Engine, list[list[RequestOutput]]]:
    """Each batch is one generate call on one fresh engine (so later batches can hit earlier ones)."""
    engine = Engine(base.config.replace(**overrides), share_weights_with=base)
    llm = LLM(engine=engine)
    outs = [llm.generate(list(b), GREEDY) for b in batches]
    assert engine.kv.num_used_blocks == 0
    assert all(o.finish_reason == "length" for batch in outs for o in batch)
    return engine, outs


def tokens(outs: list[list[RequestOutput]]) -> list[list[list[int]]]:
    return [[o.output_token_ids for o in batch] for batch in outs]


def test_caching_on_equals_off_and_counts_exactly_the_shared_tokens(base: Engine) -> None:
    first, rest = PROMPTS[0], PROMPTS[1:]
    batches = [[first], rest]
    off_engine, off = run(base, batches, enable_prefix_caching=False)
    on_engine, on = run(base, batches, enable_prefix_caching=True)
    assert tokens(on) == tokens(off)
    assert all(o.num_cached_tokens == 0 for batch in off for o in batch)
    # the 2nd call is admitted in one step: its prompts hit the 1st call's blocks (its prompt
    # and all but its last output token were computed) and the full blocks of the prompts
    # admitted before them in the same step, which are cached as soon as they are scheduled
    computed = first + on[0][0].output_token_ids[:-1]
    full = [
        max(expected_cached(p, seen) for seen in [computed, *rest[:i]]) for i, p in enumerate(rest)
    ]
    assert full == [20, 4, 12, 16, 0, 28]
    # then a partial hit: the first tokens of the 1st call's block after the last full hit
    # (blocks of this step's prompts are not written yet), below the prompt's last token
    partial = [
        min(common_prefix(p[n:], computed[n : n + BS]), len(p) - 1 - n)
        for p, n in zip(rest, full, strict=True)
    ]
    assert partial == [3, 2, 0, 3, 0, 1 + common_prefix([7] * 3, on[0][0].output_token_ids[:3])]
    want = [f + p for f, p in zip(full, partial, strict=True)]
    assert [o.num_cached_tokens for o in on[1]] == want
    assert on[0][0].num_cached_tokens == 0
    assert (on_engine.kv.num_hits, off_engine.kv.num_hits) == (sum(want), 0)


def test_caching_on_equals_off_within_one_call_with_chunked_prefill(base: Engine) -> None:
    # one slot and a 6-token budget: requests run one after another, in chunks, each able to
    # reuse the blocks of those before it
    batches = [PROMPTS]
    overrides = dict(max_num_seqs=1, max_num_batched_tokens=6)
    _, off = run(base, batches, enable_prefix_caching=False, **overrides)
    _, on = run(base, batches, enable_prefix_caching=True, **overrides)
    assert tokens(on) == tokens(off)
    cached = [o.num_cached_tokens for o in on[0]]
    # the 2nd shares 5 full blocks and 3 tokens of the next with the 1st; the repeat takes all
    # but its last block (that block holds only its last token)
    assert cached[1] == 23 and cached[3] == 12 and cached[5] == 0
    assert sum(cached) > 0


def test_caching_on_equals_off_across_preemptions(base: Engine) -> None:
    # room for two or three requests at a time: requests are preempted and readmitted, and
    # readmission may hit their own or others' surviving blocks
    kv = base.kv_bytes_per_block * 16
    batches = [PROMPTS]
    off_engine, off = run(base, batches, enable_prefix_caching=False, kv_cache_memory=kv)
    on_engine, on = run(base, batches, enable_prefix_caching=True, kv_cache_memory=kv)
    assert on_engine.total_preemptions > 0 and off_engine.total_preemptions > 0
    assert tokens(on) == tokens(off)
    assert on_engine.kv.num_hits > 0


def test_reset_prefix_cache_makes_the_next_request_start_cold(base: Engine) -> None:
    engine, outs = run(base, [[PROMPTS[0]], [PROMPTS[0]]])
    assert (
        outs[1][0].num_cached_tokens == 28
    )  # its 7 full blocks; the 8th holds only its last token
    engine.reset_prefix_cache()
    again = LLM(engine=engine).generate([PROMPTS[0]], GREEDY)
    assert again[0].num_cached_tokens == 0
    assert again[0].output_token_ids == outs[0][0].output_token_ids
    # and the blocks it computed are cached again for the next one
    assert LLM(engine=engine).generate([PROMPTS[0]], GREEDY)[0].num_cached_tokens == 28


SYSTEM = (
    "You are a careful assistant for a large offline evaluation job. Answer in one short "
    "paragraph, state assumptions, and never invent citations."
)
QUESTIONS = [
    "What is a KV cache?",
    "What is a KV cache used for?",  # shares part of a block with the first
    "Name three prime numbers.",
]


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_caching_on_equals_off(smollm2_engine: Engine) -> None:
    """A shared system prompt, two questions that share part of a block, a repeated prompt,
    and a KV cache small enough to preempt with or without sharing."""
    e = smollm2_engine
    bs = e.config.block_size
    prompts = [
        e.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS
    ]
    prompts.append(prompts[0])
    assert common_prefix(prompts[0], prompts[1]) % bs != 0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    longest = max(len(p) for p in prompts) + 8
    kv = e.kv_bytes_per_block * (-(-longest // bs) + 2)  # one request and 2 blocks
    results = {}
    for caching in (False, True):
        engine = Engine(
            e.config.replace(enable_prefix_caching=caching, kv_cache_memory=kv, num_threads=1),
            share_weights_with=e,
        )
        llm = LLM(engine=engine)
        outs = llm.generate(prompts[:1], params) + llm.generate(
            prompts[1:], params
        )  # 2nd call reuses the 1st's blocks
        assert engine.total_preemptions > 0
        results[caching] = ([o.output_token_ids for o in outs], [o.num_cached_tokens for o in outs])
    assert results[True][0] == results[False][0]
    assert results[False][1] == [0] * 4
    # the system prompt's full blocks are shared by all; the repeat reuses its first run down
    # to the token (a partial hit in its last block), capped below its last token
    assert all(n >= bs for n in results[True][1][1:])
    assert results[True][1][3] == len(prompts[0]) - 1
