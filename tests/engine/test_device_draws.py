"""Device draws: the sampler's uniform numbers from a counter-based generator on the device
(cbgen_kernels.uniform_draws, Philox keyed by the request's seed at its draw count), the CUDA
path. Here in the Triton interpreter; compiled on a GPU by the GPU check."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import cbgen_kernels
import pytest
import torch

import cbgen.engine.engine as engine_module
from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.runner import ModelRunner
from cbgen.engine.sampler import Sampler, SamplingRow, SamplingTensors, seed_int64
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

if not torch.cuda.is_available() and not cbgen_kernels.interpreted():
    pytest.skip("no CUDA and the Triton interpreter is off", allow_module_level=True)

DEVICE: Literal["cpu", "cuda"] = "cpu" if cbgen_kernels.interpreted() else "cuda"


def draws(seeds: list[int], counters: list[int]) -> list[float]:
    s = torch.tensor([seed_int64(x) for x in seeds], device=DEVICE)
    c = torch.tensor(counters, dtype=torch.int64, device=DEVICE)
    return cbgen_kernels.uniform_draws(s, c).tolist()


# ---- the kernel ---------------------------------------------------------------------------


def test_a_draw_depends_on_its_seed_and_counter_alone() -> None:
    pairs = [(7, 0), (7, 1), (8, 0), (123456789012345, 5), (2**64 - 1, 3), (0, 2**31 + 4)]
    alone = [draws([s], [c])[0] for s, c in pairs]
    # in one batch, reversed, and mixed with other rows at other positions
    assert draws([s for s, _ in pairs], [c for _, c in pairs]) == alone
    rev = pairs[::-1]
    assert draws([s for s, _ in rev], [c for _, c in rev]) == alone[::-1]
    others = torch.Generator().manual_seed(3)
    fill = torch.randint(0, 1 << 40, (2 * len(pairs), 2), generator=others).tolist()
    mixed_seeds, mixed_counters = [], []
    for (s, c), (a, b) in zip(pairs, fill[: len(pairs)], strict=True):
        mixed_seeds += [a, s]
        mixed_counters += [b, c]
    assert draws(mixed_seeds, mixed_counters)[1::2] == alone
    # distinct pairs give distinct numbers: another counter, another seed
    assert len(set(alone)) == len(alone)


def test_draws_are_in_unit_interval_and_roughly_uniform() -> None:
    n = 4096
    # one request's stream (its counters) and many requests' first draws (their seeds)
    stream = torch.tensor(draws([42] * n, list(range(n))))
    firsts = torch.tensor(draws(list(range(n)), [0] * n))
    for u in (stream, firsts):
        assert bool(((u >= 0) & (u < 1)).all())
        # Kolmogorov-Smirnov distance to U(0, 1): about 0.02 at the 1 % level for n = 4096
        ranked = u.sort().values.double()
        grid = torch.arange(1, n + 1, dtype=torch.float64) / n
        ks = max((grid - ranked).abs().max().item(), (ranked - (grid - 1 / n)).abs().max().item())
        assert ks < 0.03
        counts = torch.histc(u, bins=10, min=0.0, max=1.0)
        assert bool((counts - n / 10).abs().max() < 0.15 * n / 10)


def test_bad_shapes_are_refused() -> None:
    seeds = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="same 1-D shape"):
        cbgen_kernels.uniform_draws(seeds, seeds[:2])
    with pytest.raises(ValueError, match="int64"):
        cbgen_kernels.uniform_draws(seeds, seeds.int())


# ---- the sampler --------------------------------------------------------------------------


def test_the_sampler_with_device_draws_is_batch_independent() -> None:
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=20),
    ]
    sampler = Sampler(device_draws=True)

    def row(i: int, draws: int) -> SamplingRow:
        return SamplingRow(params[i], [1, 2], 2, None, (), seed=100 + i, draws=draws)

    # each row's tokens over 30 draws, alone, then inside the batch in another order
    alone = [
        [sampler(logits[i : i + 1].clone(), [row(i, d)])[0] for d in range(30)] for i in range(4)
    ]
    order = [3, 1, 0, 2]
    batched = [sampler(logits[order].clone(), [row(i, d) for i in order]) for d in range(30)]
    for j, i in enumerate(order):
        assert [step[j] for step in batched] == alone[i]
    assert len(set(alone[0])) > 5  # the counter moves the stream on
    # staged seeds and counters (the runner's way) give the same tokens as the rows' fields
    staged = SamplingTensors(
        *(
            torch.tensor(values, device=DEVICE)
            for values in (
                [p.temperature for p in params],
                [p.top_k for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [100 + i for i in range(4)],
                [9] * 4,
            )
        )
    )
    rows = [row(i, 9) for i in range(4)]
    assert sampler(logits.clone(), rows, staged) == [a[9] for a in alone]


# ---- through the engine -------------------------------------------------------------------


def device_draw_engine(config: EngineConfig, **kwargs: Engine) -> Engine:
    """An engine whose runner takes device draws (on the CPU too: the interpreter's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "ModelRunner", functools.partial(ModelRunner, device_draws=True))
        return Engine(config, **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Engine:
    return device_draw_engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device=DEVICE,
            dtype="float32",
            kv_cache_memory=4 << 20,
            block_size=4,
            num_threads=1,
            enforce_eager=True,
        )
    )


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [100, 3, 77, 42, 42, 9, 250, 17, 33, 61, 12, 8, 190, 4, 4],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [200, 201, 202, 13],
]


def test_seeded_requests_are_the_same_alone_in_a_batch_and_after_preemption(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.runner.device_draws and engine.runner.sampler.device_draws
    calls: list[int] = []
    real = cbgen_kernels.uniform_draws

    def counted(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        calls.append(len(seeds))
        return real(seeds, counters)

    monkeypatch.setattr(cbgen_kernels, "uniform_draws", counted)
    params = [
        SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=1),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, seed=77),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True, seed=78),
        SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=2**63 + 5),
    ]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    alone = [
        LLM(engine=engine).generate([p], sp)[0].output_token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    assert not engine.runner.generators  # no host generator made
    assert sum(calls) == 16 * 4  # one device draw per sampled token of each random request
    # busy: chunked prefill (budget 6) and a KV cache so small that requests are preempted
    busy_engine = device_draw_engine(
        engine.config.replace(
            max_num_batched_tokens=6, kv_cache_memory=engine.kv_bytes_per_block * 14
        ),
        share_weights_with=engine,
    )
    outs = LLM(engine=busy_engine).generate(prompts, params)
    assert [o.output_token_ids for o in outs] == alone
    assert any(o.num_preemptions > 0 for i, o in enumerate(outs) if not params[i].greedy)
    assert alone[2] != alone[4]  # the same prompt, another seed: another stream
