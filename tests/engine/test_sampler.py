"""Sampling: greedy, the top-k / top-p / min-p masks and the penalties against a direct
computation, min_tokens, seeded draws (the same alone and in any batch), and the draws'
distribution; then through the engine on a tiny model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from cbgen.config import EngineConfig
from cbgen.cpu import build, kernels
from cbgen.engine.engine import Engine
from cbgen.engine.logit_processors import apply_penalties, apply_penalties_rows, filter_logits
from cbgen.engine.sampler import Sampler, SamplingRow
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams


def row(
    params: SamplingParams,
    token_ids: Sequence[int] = (1, 2, 3),
    prompt_len: int = 3,
    seed: int | None = None,
    stop_ids: Sequence[int] = (),
) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(token_ids), prompt_len, gen, list(stop_ids))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def direct_keep(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The tokens top-k, then top-p, then min-p keep, computed the plain way in float64."""
    order = sorted(range(len(logits)), key=lambda v: -logits[v])
    kept = order[:top_k] if top_k > 0 else order
    p = softmax(logits[kept].astype(np.float64))
    nucleus, mass = [], 0.0
    for v, pv in zip(kept, p, strict=True):
        if mass >= top_p:  # the mass strictly before v already reaches top_p
            break
        nucleus.append((v, pv))
        mass += pv
    if top_p >= 1.0:
        nucleus = list(zip(kept, p, strict=True))
    total = sum(pv for _, pv in nucleus)
    pmax = max(pv for _, pv in nucleus) / total
    keep = np.zeros(len(logits), dtype=bool)
    for v, pv in nucleus:
        keep[v] = pv / total >= min_p * pmax
    return keep


# ---- masks --------------------------------------------------------------------------------


def test_top_k_top_p_min_p_masks_match_a_direct_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=gen) * 2.0
    settings = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0),
                (0, 1.0, 0.1), (10, 0.8, 0.05), (3, 0.3, 0.5)]  # fmt: skip
    k = torch.tensor([s[0] for s in settings])
    p = torch.tensor([s[1] for s in settings])
    m = torch.tensor([s[2] for s in settings])
    got = torch.isfinite(filter_logits(logits.clone(), k, p, m)).numpy()
    for i, (tk, tp, mp) in enumerate(settings):
        want = direct_keep(logits[i].numpy(), tk, tp, mp)
        assert (got[i] == want).all(), f"row {i} {settings[i]}"
        assert 1 <= want.sum() < 64 or (tk, tp, mp) == (0, 1.0, 0.0)
    assert got[1].sum() == 1 and got[1][int(logits[1].argmax())]  # top_k = 1: the argmax only
    # kept logits are unchanged
    out = filter_logits(logits.clone(), k, p, m)
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_top_p_one_keeps_every_token_beside_rows_that_cut() -> None:
    """The cumulative sum over a large vocabulary rounds past 1.0: a top_p=1 row in a batch with
    a top_p<1 row must still keep its whole tail."""
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1)) * 3.0
    out = filter_logits(
        logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.9]), torch.tensor([0.0, 0.0])
    )
    assert bool(torch.isfinite(out[0]).all())
    assert int(torch.isfinite(out[1]).sum()) < 49152


# ---- penalties ----------------------------------------------------------------------------


def direct_penalties(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    out = []
    for v, x in enumerate(logits):
        if v in prompt or v in output:
            x = x / rep if x > 0 else x * rep
        c = output.count(v)
        out.append(x - freq * c - pres * (c > 0))
    return out


@pytest.mark.parametrize(
    ("rep", "pres", "freq"),
    [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.4), (1.5, -0.5, 0.25)],
)
def test_penalties_match_a_direct_computation(rep: float, pres: float, freq: float) -> None:
    logits = [2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.5, -0.25]
    prompt, output = [0, 1, 1], [3, 3, 3, 4, 0]
    got = apply_penalties(torch.tensor(logits), prompt, output, rep, pres, freq)
    assert got.tolist() == pytest.approx(
        direct_penalties(logits, prompt, output, rep, pres, freq), abs=1e-6
    )


def test_penalties_of_a_batch_equal_those_row_by_row() -> None:
    """apply_penalties_rows (one copy, batched tensor operations: the sampler's path) gives
    each penalised row the very bits apply_penalties gives it alone, and leaves the other rows
    as they were; rows of different lengths pad without touching the vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 4
    logits[1, 7] = float("-inf")
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=0.8),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=1.1, presence_penalty=-0.3),
    ]
    ids = [[1, 2, 2, 9], [7, 7, 3, 49, 0, 0, 0], [4], [5, 6], [8, 8, 8, 8, 8, 1]]
    rows = [row(p, t, 2) for p, t in zip(params, ids, strict=True)]
    want = logits.clone()
    for i in (0, 1, 3, 4):
        r = rows[i]
        p = r.params
        apply_penalties(
            want[i],
            r.prompt_token_ids,
            r.output_token_ids,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
    got = logits.clone()
    apply_penalties_rows(got, [(i, rows[i]) for i in (0, 1, 3, 4)])
    assert torch.equal(got, want) and torch.equal(got[2], logits[2])


def test_greedy_sampling_applies_penalties_first() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    base = SamplingParams(temperature=0.0, max_tokens=8)
    assert Sampler()(logits.clone(), [row(base, [2, 0], 1)]) == [0]
    # token 0 was generated once: a frequency penalty of 0.2 puts 1.9 ahead of 1.8
    assert Sampler()(logits.clone(), [row(base.replace(frequency_penalty=0.2), [2, 0], 1)]) == [1]
    # repetition penalty counts the prompt too: 2.0 / 1.1 < 1.9
    assert Sampler()(logits.clone(), [row(base.replace(repetition_penalty=1.1), [0], 1)]) == [1]


# ---- greedy, min_tokens --------------------------------------------------------------------


def test_temperature_zero_and_top_k_one_are_greedy() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    rows_ = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.5, top_k=1), seed=1),
        row(SamplingParams(temperature=0.0, top_p=0.5, seed=9)),
        row(SamplingParams(temperature=2.0, top_k=1, min_p=0.3), seed=2),
    ]
    assert Sampler()(logits.clone(), rows_) == logits.argmax(dim=-1).tolist()


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    # 1 output token so far (< 2): EOS 1 and stop id 2 are masked; 3 wins
    assert Sampler()(logits.clone(), [row(params, [0, 0, 9], 2, stop_ids=[1, 2])]) == [3]
    # 2 output tokens: nothing is held back
    assert Sampler()(logits.clone(), [row(params, [0, 0, 9, 9], 2, stop_ids=[1, 2])]) == [1]
    # a stop id outside the vocabulary cannot be sampled anyway, and must not crash
    assert Sampler()(logits.clone(), [row(params, [0, 0], 2, stop_ids=[1, 10_000])]) == [2]


# ---- seeded random draws --------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, top_p=0.95, seed=123),
        SamplingParams(temperature=0.8, seed=123),
    ],
    ids=["masked", "plain"],  # the torch ops / on the CPU, the C kernel, whatever the batch holds
)
def test_a_seeded_row_draws_the_same_alone_and_in_a_batch(target: SamplingParams) -> None:
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    others = [
        SamplingParams(temperature=t, top_k=k)
        for t, k in [(1.0, 0), (0.0, 0), (0.5, 5), (1.2, 0), (0.9, 2)]
    ]
    other_rows = [row(p, seed=40 + i) for i, p in enumerate(others)]
    # the same 20 steps, alone and as row 2 of 6 (the others: other generators, greedy rows)
    g_alone, g_batch = row(target, seed=123), row(target, seed=123)
    seq_alone, seq_batch = [], []
    for _ in range(20):
        seq_alone.append(Sampler()(logits[2:3].clone(), [g_alone])[0])
        seq_batch.append(Sampler()(logits.clone(), [*other_rows[:2], g_batch, *other_rows[2:]])[2])
    assert seq_alone == seq_batch
    assert len(set(seq_alone)) > 3  # a real draw, not an argmax


@pytest.mark.parametrize("top_k", [4, 0])
def test_draws_follow_the_filtered_distribution(top_k: int) -> None:
    """4000 rows, each with its own seed, all drawing from softmax(logits / T), cut to top-k
    (torch ops) or whole (on the CPU, the C kernel)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    params = SamplingParams(temperature=0.7, top_k=top_k)
    n = 4000
    rows_ = [row(params, seed=s) for s in range(n)]
    draws = Sampler()(logits.repeat(n, 1), rows_)
    counts = np.bincount(draws, minlength=6)
    kept = [5, 0, 1, 2] if top_k else [5, 0, 1, 2, 3, 4]  # the largest logits
    p = softmax(logits.numpy()[kept] / 0.7)
    assert counts[[v for v in range(6) if v not in kept]].sum() == 0
    for v, pv in zip(kept, p, strict=True):
        sigma = math.sqrt(n * pv * (1 - pv))
        assert abs(counts[v] - n * pv) < 4.5 * sigma, (v, counts[v], n * pv)


def test_rows_without_masks_draw_what_the_torch_ops_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel is the torch rule in fewer passes: 64 seeded rows over a 49,152-token
    vocabulary, some greedy, some masked, draw the same tokens with and without it."""
    logits = 4 * torch.randn(64, 49152, generator=torch.Generator().manual_seed(9))
    logits[:, ::11] = float("-inf")
    params = [
        SamplingParams(temperature=0.0)
        if i % 9 == 0
        else SamplingParams(temperature=1.0, top_p=0.9)
        if i % 5 == 0
        else SamplingParams(temperature=[1.0, 0.6, 1.7][i % 3])
        for i in range(64)
    ]

    def draw() -> list[list[int]]:
        # the CPU runtime's sampler: the C kernel for the rows without masks
        rows_ = [row(p, seed=100 + i) for i, p in enumerate(params)]
        return [Sampler(plain_sample=kernels.sample)(logits.clone(), rows_) for _ in range(3)]

    calls: list[int] = []
    inner = kernels.sample
    monkeypatch.setattr(kernels, "sample", lambda x, *a: calls.append(x.shape[0]) or inner(x, *a))
    with_kernel = draw()
    if inner(logits[:1], torch.ones(1), torch.zeros(1)) is None:
        pytest.skip(build.native_status())
    assert calls == [sum(1 for p in params if not p.greedy and p.top_p == 1.0)] * 3
    monkeypatch.setattr(kernels, "sample", lambda *a: None)
    assert draw() == with_kernel
    assert len({t for step in with_kernel for t in step}) > 100


# ---- through the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            dtype="float32",
            kv_cache_memory=4 << 20,
            block_size=4,
            num_threads=1,  # two test workers share two cores
        )
    )


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190, 4, 4],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [200, 201, 202, 13],
]


def test_engine_greedy_temperature_zero_equals_top_k_one(engine: Engine) -> None:
    llm = LLM(engine=engine)
    zero = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    top1 = llm.generate(
        PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True, seed=5)
    )
    assert [o.output_token_ids for o in zero] == [o.output_token_ids for o in top1]
    assert all(len(o.output_token_ids) == 12 for o in zero)


@pytest.mark.parametrize("top_p", [0.9, 1.0], ids=["logits", "plain"])  # plain: the CPU's bf16 head
def test_engine_seeded_request_is_the_same_alone_and_in_a_busy_batch(
    engine: Engine, top_p: float
) -> None:
    target = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=16, ignore_eos=True, seed=77)
    alone = LLM(engine=engine).generate([PROMPTS[1]], target)[0].output_token_ids
    # busy: other sampled and greedy requests ahead of and behind it, chunked prefill
    # (budget 6) and a KV cache so small that requests are preempted and recomputed
    busy_engine = Engine(
        engine.config.replace(
            max_num_batched_tokens=6, kv_cache_memory=engine.kv_bytes_per_block * 14
        ),
        share_weights_with=engine,
    )
    params = [
        SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        target,
        SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True, seed=77 + 1),
        SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
    ]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    outs = LLM(engine=busy_engine).generate(prompts, params)
    assert busy_engine.total_preemptions > 0
    assert outs[2].output_token_ids == alone
    # another seed or no seed on the same prompt: another stream
    assert outs[4].output_token_ids != alone
    assert busy_engine.kv.num_used_blocks == 0


def test_the_cpu_runtime_gives_the_engines_sampler_its_kernel(engine: Engine) -> None:
    """The engine's sampler takes the C kernel for plain rows because the CPU runtime gives it
    (the sampler itself knows no device's kernels)."""
    assert engine.runtime.plain_sample is kernels.sample
    assert engine.runner.sampler.plain_sample is kernels.sample
