"""Bench workloads (ShareGPT sampling rules, random, file, prefix), arrival times, the runner
and the summary figures; on a tiny dummy-weight model with token-id prompts."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cbgen.bench import sharegpt
from cbgen.bench.command import _ratio_columns, parse_sweep, plan_columns
from cbgen.bench.report import summarize
from cbgen.bench.runner import run_workload
from cbgen.bench.workloads import (
    BenchRequest,
    file_workload,
    fold_into_vocab,
    poisson_arrivals,
    prefix_workload,
    random_workload,
)
from cbgen.config import EngineConfig, parse_size
from cbgen.engine.engine import Engine
from tools.model_shapes import TINY_LLAMA


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = tmp_path_factory.mktemp("tiny-bench")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return Engine(
        EngineConfig(model=str(folder), load_format="dummy", kv_cache_memory=4 << 20, num_threads=1)
    )


# ---- ShareGPT --------------------------------------------------------------------------------
def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per word, so lengths can be counted by hand."""
    return list(range(len(text.split())))


def conv(*turns: tuple[str, int]) -> dict[str, Any]:
    return {"conversations": [{"from": who, "value": " ".join(["w"] * n)} for who, n in turns]}


RECORDS = [
    conv(("human", 5), ("gpt", 6)),  # 0 kept
    conv(("human", 3), ("gpt", 6)),  # 1 prompt under 4 tokens
    conv(("human", 5), ("gpt", 3)),  # 2 reply under 4 tokens
    conv(("gpt", 9), ("human", 4), ("gpt", 4)),  # 3 kept: the first *human* turn, 4 + 4
    conv(("human", 7)),  # 4 no reply
    conv(("human", 20), ("gpt", 5)),  # 5 prompt over max_prompt_len=12
    conv(("human", 8), ("gpt", 30)),  # 6 over max_total_len=30 in all, unless the reply is capped
    conv(("human", 6), ("human", 6), ("gpt", 6)),  # 7 the first human turn has no reply
    {"id": "no-conversations"},  # 8
    conv(("human", 12), ("gpt", 18)),  # 9 kept: exactly 30 in all
]


def write_sharegpt(path: Path, records: list[Any], cut: str | None = None) -> Path:
    """The records as a JSON array; cut: end the file one byte into the last occurrence of
    this text (inside a multi-byte character when it starts with one)."""
    data = json.dumps(records, indent=2, ensure_ascii=False).encode()
    if cut is not None:
        data = data[: data.rindex(cut.encode()) + 1]
    path.write_bytes(data)
    return path


def sample(path: Path, n: int = 100, seed: int = 0, **kw: Any) -> list[BenchRequest]:
    return sharegpt.sample_sharegpt(
        words,
        lambda t: len(t.split()),
        n,
        seed,
        path=path,
        **{"max_prompt_len": 12, "max_total_len": 30, **kw},
    )


def test_sharegpt_sampling_rules(tmp_path: Path) -> None:
    path = write_sharegpt(tmp_path / "sg.json", RECORDS)
    got = {r.request_id: (r.prompt_len, r.output_len) for r in sample(path)}
    assert got == {"sharegpt-0": (5, 6), "sharegpt-3": (4, 4), "sharegpt-9": (12, 18)}
    # a capped reply keeps its capped length; a pair that fits once capped is kept
    capped = {r.request_id: (r.prompt_len, r.output_len) for r in sample(path, max_output_len=12)}
    assert capped == {
        "sharegpt-0": (5, 6),
        "sharegpt-3": (4, 4),
        "sharegpt-6": (8, 12),
        "sharegpt-9": (12, 12),
    }
    # under 4 tokens is judged before capping
    assert {r.request_id for r in sample(path, max_output_len=2)} == {
        "sharegpt-0",
        "sharegpt-3",
        "sharegpt-6",
        "sharegpt-9",
    }


def test_sharegpt_shuffle_follows_the_seed_and_stops_at_num_prompts(tmp_path: Path) -> None:
    records = [conv(("human", 4 + i % 7), ("gpt", 4 + i % 5)) for i in range(40)]
    path = write_sharegpt(tmp_path / "sg.json", records)
    for seed in (0, 1):
        order = list(range(40))
        random.Random(seed).shuffle(order)
        got = sample(path, n=10, seed=seed)
        assert [r.request_id for r in got] == [f"sharegpt-{i}" for i in order[:10]]
        assert [(r.prompt_len, r.output_len) for r in got] == [
            (4 + i % 7, 4 + i % 5) for i in order[:10]
        ]
    assert [r.request_id for r in sample(path, n=10, seed=0)] != [
        r.request_id for r in sample(path, n=10, seed=1)
    ]


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_sharegpt_reader_stops_cleanly_at_a_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(sharegpt, "_CHUNK", chunk)
    records = [
        {"id": f"é{i}", "conversations": [{"from": "human", "value": "ü" * i}]} for i in range(5)
    ]
    whole = write_sharegpt(tmp_path / "whole.json", records)
    assert list(sharegpt.iter_records(whole)) == records
    # cut inside the last record (as the packaged file is), and right after a comma
    cut = write_sharegpt(tmp_path / "cut.json", records, cut="üü")
    assert list(sharegpt.iter_records(cut)) == records[:4]
    text = json.dumps(records[:3])[:-1] + ","
    (tmp_path / "comma.json").write_text(text, encoding="utf-8")
    assert list(sharegpt.iter_records(tmp_path / "comma.json")) == records[:3]


def test_sharegpt_real_file_first_records() -> None:
    path = sharegpt.default_dataset_path()
    first = list(itertools.islice(sharegpt.iter_records(path), 3))
    assert first[0]["id"] == "QWJhYvA_0"
    prompt, reply = sharegpt.first_exchange(first[0])  # type: ignore[misc]
    assert prompt.startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert reply.startswith("Here are the main ideas of Jeff Walker's Product Launch Formula")


# ---- synthetic workloads ----------------------------------------------------------------------
def test_random_workload_lengths_and_seed() -> None:
    a = random_workload(200, 100, 20, 0.5, 512, seed=3)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert {r.prompt_len for r in a} != {100}
    assert all(0 <= t < 512 for r in a for t in r.prompt_token_ids)
    assert a == random_workload(200, 100, 20, 0.5, 512, seed=3)
    assert a != random_workload(200, 100, 20, 0.5, 512, seed=4)
    fixed = random_workload(5, 64, 8, 0.0, 512, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(64, 8)] * 5


def test_prefix_workload_shares_prefixes_in_turn() -> None:
    reqs = prefix_workload(
        7, prefix_len=20, num_prefixes=3, suffix_len=5, output_len=4, vocab_size=512, seed=1
    )
    assert [r.prompt_len for r in reqs] == [25] * 7 and {r.output_len for r in reqs} == {4}
    prefixes = [r.prompt_token_ids[:20] for r in reqs[:3]]
    assert len({tuple(p) for p in prefixes}) == 3
    for i, r in enumerate(reqs):
        assert r.prompt_token_ids[:20] == prefixes[i % 3]
    assert len({tuple(r.prompt_token_ids[20:]) for r in reqs}) == 7


def test_file_workload(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    p.write_text(
        '{"id": "a", "prompt_token_ids": [1, 2, 3], "output_len": 5}\n\n'
        '{"prompt": "one two three four", "output_len": 2}\n'
        '{"custom_id": "c", "prompt": [{"role": "user", "content": "hi there"}], "output_len": 1}\n'
    )
    got = file_workload(p, lambda x: words(x) if isinstance(x, str) else [7, 7], None)
    assert got == [
        BenchRequest("a", [1, 2, 3], 5),
        BenchRequest("1", [0, 1, 2, 3], 2),
        BenchRequest("c", [7, 7], 1),
    ]
    assert len(file_workload(p, words, 1)) == 1
    p.write_text('{"prompt_token_ids": [1], "output_len": 0}\n')
    with pytest.raises(ValueError, match="output_len"):
        file_workload(p, words, None)
    assert fold_into_vocab([BenchRequest("x", [5, 600, 1030], 2)], 512) == [
        BenchRequest("x", [5, 88, 6], 2)
    ]


def test_options_parsing() -> None:
    assert parse_sweep("max_num_seqs=1,8,32") == ("max_num_seqs", [1, 8, 32])
    assert parse_sweep("enable-prefix-caching=true,false") == (
        "enable_prefix_caching",
        [True, False],
    )
    assert parse_sweep("kv_cache_memory=1MiB,2048") == ("kv_cache_memory", [1 << 20, 2048])
    for bad in ("model=a,b", "max_num_seqs", "max_num_seqs=x", "nope=1"):
        with pytest.raises(ValueError, match="sweep"):
            parse_sweep(bad)
    assert (
        parse_size("4GiB") == 4 << 30
        and parse_size("512M") == 512 << 20
        and parse_size("100") == 100
    )
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5KiB") == 1536
    assert [c.label for c in plan_columns("continuous", "static", None)] == ["continuous", "static"]
    cols = plan_columns("continuous", "static", ("max_num_seqs", [1, 4]))
    assert [(c.label, c.policy, c.overrides) for c in cols] == [
        ("continuous max_num_seqs=1", "continuous", {"max_num_seqs": 1}),
        ("static max_num_seqs=1", "static", {"max_num_seqs": 1}),
        ("continuous max_num_seqs=4", "continuous", {"max_num_seqs": 4}),
        ("static max_num_seqs=4", "static", {"max_num_seqs": 4}),
    ]
    assert [c.label for c in plan_columns("static", None, ("block_size", [8]))] == ["block_size=8"]
    # a value given again is a repeat (to see the run-to-run spread), not a column to overwrite
    again = plan_columns("continuous", None, ("max_num_seqs", [64, 256, 64, 64]))
    assert [c.label for c in again] == [
        "max_num_seqs=64",
        "max_num_seqs=256",
        "max_num_seqs=64 #2",
        "max_num_seqs=64 #3",
    ]
    both = plan_columns("continuous", "static", ("max_num_seqs", [4, 4]))
    assert [c.label for c in both] == [
        "continuous max_num_seqs=4",
        "static max_num_seqs=4",
        "continuous max_num_seqs=4 #2",
        "static max_num_seqs=4 #2",
    ]
    fake = {c.label: {"output_tokens_per_s": 10.0 * (i + 1)} for i, c in enumerate(both)}
    ratios = _ratio_columns(both, fake)
    assert list(ratios) == [
        "continuous / static max_num_seqs=4",
        "continuous / static max_num_seqs=4 #2",
    ]
    assert ratios["continuous / static max_num_seqs=4"]["output_tokens_per_s"] == pytest.approx(
        10.0 / 20.0
    )
    assert ratios["continuous / static max_num_seqs=4 #2"]["output_tokens_per_s"] == pytest.approx(
        30.0 / 40.0
    )


# ---- arrivals and the runner ---------------------------------------------------------------------
def test_poisson_arrivals_follow_the_seeded_process() -> None:
    got = poisson_arrivals(6, 2.0, seed=5)
    gaps = np.random.default_rng(5).exponential(0.5, size=5)
    assert got == pytest.approx([0.0, *np.cumsum(gaps)])
    assert poisson_arrivals(3, None, seed=5) == [0.0, 0.0, 0.0]
    many = np.diff(poisson_arrivals(20001, 4.0, seed=0))
    assert many.mean() == pytest.approx(0.25, rel=0.03)
    assert np.std(many) == pytest.approx(0.25, rel=0.03)  # exponential: sd == mean
    assert poisson_arrivals(5, 4.0, seed=1) != poisson_arrivals(5, 4.0, seed=2)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def test_runner_adds_requests_at_their_arrival_times(weights: Engine) -> None:
    engine = Engine(weights.config, share_weights_with=weights)
    reqs = random_workload(4, 16, 3, 0.0, 512, seed=0)
    arrivals = [0.0, 0.0, 0.25, 0.5]
    run = run_workload(engine, reqs, arrivals, label="x", num_warmup=1)
    assert [r.arrival_s for r in run.requests] == arrivals
    assert [r.output_tokens for r in run.requests] == [3] * 4
    assert all(r.queue_s is not None and r.queue_s >= 0 for r in run.requests)
    assert run.wall_s >= 0.5
    # queue_s = first scheduled - arrival >= 0: no request entered the engine before its time
    s = summarize(run)
    assert s["num_errors"] == 0 and s["output_tokens"] == 12


def test_prefix_workload_cache_hits_are_counted(weights: Engine) -> None:
    """8 requests over 2 prefixes of 32 tokens (2 blocks of 16) + 8 private tokens; a step
    admits about one prompt, so every request after the first two finds its prefix cached:
    6 x 32 cached tokens of 8 x 40."""
    reqs = prefix_workload(
        8, prefix_len=32, num_prefixes=2, suffix_len=8, output_len=2, vocab_size=512, seed=0
    )
    on = Engine(weights.config.replace(max_num_batched_tokens=40), share_weights_with=weights)
    s_on = summarize(run_workload(on, reqs, [0.0] * 8, label="on", num_warmup=1))
    assert (s_on["cached_tokens"], s_on["step_cached_tokens"], s_on["prompt_tokens"]) == (
        192,
        192,
        320,
    )
    assert s_on["cache_hit_rate"] == pytest.approx(0.6)
    off = Engine(
        weights.config.replace(max_num_batched_tokens=40, enable_prefix_caching=False),
        share_weights_with=weights,
    )
    s_off = summarize(run_workload(off, reqs, [0.0] * 8, label="off", num_warmup=1))
    assert (s_off["cached_tokens"], s_off["cache_hit_rate"]) == (0, 0.0)
    assert s_off["computed_tokens"] - s_on["computed_tokens"] == 192


def test_summary_figures(weights: Engine) -> None:
    reqs = [BenchRequest(f"q{i}", [10 + i] * (8 + i), 4 + 2 * i) for i in range(4)]
    static = Engine(
        weights.config.replace(scheduling_policy="static", static_batch_size=2),
        share_weights_with=weights,
    )
    run = run_workload(static, reqs, [0.0] * 4, label="static", num_warmup=2)
    s = summarize(run)
    assert [r.output_tokens for r in run.requests] == [4, 6, 8, 10]
    assert s["output_tokens"] == 28 and s["prompt_tokens"] == 8 + 9 + 10 + 11
    assert s["output_tokens_per_s"] == pytest.approx(28 / run.wall_s)
    assert s["total_tokens_per_s"] == pytest.approx((28 + 38) / run.wall_s)
    # batches {q0, q1}, {q2, q3}: pads 1 and 1; q0 computes 2 tokens after it is done, q2 too
    assert (s["pad_tokens"], s["discarded_tokens"]) == (2, 4)
    assert s["computed_tokens"] == 38 + 2 + (3 + 5) + (7 + 9) + 4
    assert s["padding_waste"] == pytest.approx(6 / s["computed_tokens"])
    assert s["slots"] == 2 and 0 < s["slot_occupancy"] <= 1
    # decode-only steps: (6 - 1) in batch 1, (10 - 1) in batch 2, two members each
    assert (s["decode_steps"], s["decode_batch_mean"]) == (14, 2.0)
    assert s["num_preemptions"] == 0
    assert s["queue_p99_s"] > 0  # q2 and q3 wait for the first batch
