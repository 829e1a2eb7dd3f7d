"""Logprobs of sampled tokens and of prompt tokens: equal to transformers' float32 log_softmax
over the same tokens, top entries best first; rows that do not ask pay nothing and change
nothing; the row fields and the run's output columns."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.cli import read_rows, run, tiny, write_jsonl

from cbgen.engine.engine import Engine
from cbgen.engine.logprobs import TokenLogprob
from cbgen.engine.outputs import RequestOutput
from cbgen.io.parse import make_params, parse_mapping
from cbgen.io.rows import ColumnSpec, RowError
from cbgen.sampling_params import SamplingParams

TOL = 1e-4
PROMPTS = [
    [5, 9, 30, 41, 7, 8, 9, 10, 11, 12, 13, 60, 61, 62, 70, 3, 4, 5, 6],
    [17, 18, 19, 200, 201, 202, 99, 98, 97, 96, 95, 94, 93],
]


def engine_for(model: Path, **options: Any) -> Engine:
    options = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 8 << 20, **options}
    return Engine(model=str(model), **options)


def generate(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o
    assert engine.kv.num_used_blocks == 0
    return outs


def hf_log_softmax(model_dir: Path) -> Callable[[Sequence[int]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(tokens: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([list(tokens)])).logits[0].float()
        return logits.log_softmax(dim=-1)

    return run


def check_entry(entry: TokenLogprob, ref: torch.Tensor, token: int, k: int) -> None:
    """entry against the reference log-softmax row ref [V] at the position that predicts token."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(ref[token])) < TOL
    top = ref.topk(k)
    assert [t.token_id for t in entry.top_logprobs] == top.indices.tolist()
    got = [t.logprob for t in entry.top_logprobs]
    assert got == sorted(got, reverse=True)
    for g, want in zip(got, top.values.tolist(), strict=True):
        assert abs(g - want) < TOL


def check_output(out: RequestOutput, ref: torch.Tensor, params: SamplingParams) -> None:
    """Every logprob of out against ref = the log-softmax at each position of prompt + output."""
    prompt, output = out.prompt_token_ids, out.output_token_ids
    if params.logprobs is None:
        assert out.logprobs is None and out.cumulative_logprob is None
    else:
        assert out.logprobs is not None and len(out.logprobs) == len(output)
        for j, (entry, token) in enumerate(zip(out.logprobs, output, strict=True)):
            check_entry(entry, ref[len(prompt) - 1 + j], token, params.logprobs)
        assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            entry = out.prompt_logprobs[j]
            assert entry is not None
            check_entry(entry, ref[j - 1], prompt[j], params.prompt_logprobs)


# ---- the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_logprobs_equal_transformers_log_softmax(
    tiny_model_dir: Callable[[str], Path], kind: str
) -> None:
    """Greedy and sampled rows, 0 and 3 top entries, and prompts scored in chunks of 8 tokens
    (19 and 13 prompt tokens: 3 and 2 chunks, the last one sampling)."""
    model = tiny_model_dir(kind)
    base = SamplingParams(max_tokens=6, ignore_eos=True)
    cases = {
        "greedy": (PROMPTS[0], base.replace(temperature=0, logprobs=3, prompt_logprobs=2)),
        "sampled": (PROMPTS[1], base.replace(temperature=1.0, seed=3, logprobs=3)),
        "own_only": (PROMPTS[1], base.replace(temperature=0.7, top_p=0.8, seed=5, logprobs=0)),
        "prompt_only": (PROMPTS[0][:11], base.replace(temperature=0, prompt_logprobs=0)),
    }
    outs = generate(engine_for(model, max_num_batched_tokens=8), cases)
    ref = hf_log_softmax(model)
    for rid, (_, params) in cases.items():
        out = outs[rid]
        check_output(out, ref(out.prompt_token_ids + out.output_token_ids), params)
    # raw log-softmax, before temperature and top-p: a sampled token may be anything but the best
    assert outs["greedy"].logprobs is not None
    assert all(e.token_id == e.top_logprobs[0].token_id for e in outs["greedy"].logprobs)


def test_rows_without_logprobs_get_none_and_the_same_tokens(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model = tiny_model_dir("llama")
    base = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = {
        "g": (PROMPTS[0], base.replace(temperature=0)),
        "s": (PROMPTS[1], base.replace(temperature=1.0, seed=11)),
        "p": (PROMPTS[1], base.replace(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=4)),
    }
    asking = {
        "lg": (PROMPTS[1], base.replace(temperature=0, logprobs=5, prompt_logprobs=5)),
        "ls": (PROMPTS[0], base.replace(temperature=1.0, seed=2, logprobs=1, prompt_logprobs=0)),
    }
    alone = generate(engine_for(model, max_num_batched_tokens=16), plain)
    mixed = generate(engine_for(model, max_num_batched_tokens=16), {**plain, **asking})
    for rid in plain:
        assert mixed[rid].output_token_ids == alone[rid].output_token_ids
        assert mixed[rid].logprobs is None and mixed[rid].prompt_logprobs is None
        assert mixed[rid].cumulative_logprob is None
    ref = hf_log_softmax(model)
    for rid, (_, params) in asking.items():
        out = mixed[rid]
        check_output(out, ref(out.prompt_token_ids + out.output_token_ids), params)


def test_prompt_logprobs_take_no_prefix_cache_hits(tiny_model_dir: Callable[[str], Path]) -> None:
    """A first request caches a 40-token prefix; a later one with the same prefix shares it,
    one with prompt_logprobs computes (and scores) every prompt token, in chunks of 8."""
    model = tiny_model_dir("qwen3")
    prefix = [(7 * i + 3) % 250 + 3 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = engine_for(model, enable_prefix_caching=True, max_num_batched_tokens=8)
    generate(engine, {"first": ([*prefix, 4, 5], params)})
    scored = params.replace(prompt_logprobs=3, logprobs=2)
    outs = generate(
        engine,
        {"shares": ([*prefix, 6, 7], params), "scored": ([*prefix, 8, 9, 10], scored)},
    )
    assert outs["shares"].num_cached_tokens >= 32
    assert outs["scored"].num_cached_tokens == 0
    ref = hf_log_softmax(model)
    out = outs["scored"]
    check_output(out, ref(out.prompt_token_ids + out.output_token_ids), scored)


def test_prompt_logprobs_survive_preemption(tiny_model_dir: Callable[[str], Path]) -> None:
    """A KV cache too small for all requests at once: preempted requests recompute their prompt
    and score each prompt token exactly once."""
    model = tiny_model_dir("llama")
    probe = engine_for(model)
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1, logprobs=1
    )
    prompts = {f"r{i}": ([(11 * i + j) % 250 + 3 for j in range(30)], params) for i in range(4)}
    # each request needs 4 blocks at the end; room for 9 makes the later ones preempt
    engine = engine_for(
        model, kv_cache_memory=9 * probe.kv_bytes_per_block, max_num_batched_tokens=16
    )
    outs = generate(engine, prompts)
    assert engine.total_preemptions > 0
    ref = hf_log_softmax(model)
    for out in outs.values():
        check_output(out, ref(out.prompt_token_ids + out.output_token_ids), params)


class RecordingHead:
    """Stands in for the exact head (a CPU without one has none): the float32 argmax,
    and the number of rows it was given."""

    MIN_TEMPERATURE = 0.25

    def __init__(self, engine: Engine) -> None:
        self.model = engine.runner.model
        self.rows: list[int] = []

    def __call__(
        self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        assert bool((temperature == 0).all())
        self.rows.append(hidden.shape[0])
        return self.model.compute_logits(hidden).argmax(dim=-1)


def test_rows_with_logprobs_take_the_float32_head(tiny_model_dir: Callable[[str], Path]) -> None:
    """The exact head makes no float32 logits: a greedy row that asks for logprobs goes
    around it, a plain greedy row still takes it."""
    model = tiny_model_dir("llama")
    engine = engine_for(model)
    head = RecordingHead(engine)
    engine.runtime.exact_head = head  # type: ignore[assignment]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = generate(
        engine,
        {"plain": (PROMPTS[0], params), "asks": (PROMPTS[1], params.replace(logprobs=2))},
    )
    assert head.rows == [1] * 5  # the plain row alone, every step
    ref = hf_log_softmax(model)
    out = outs["asks"]
    check_output(out, ref(out.prompt_token_ids + out.output_token_ids), params.replace(logprobs=2))


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_logprobs_match_transformers(smollm2_engine: Engine, smollm2_hf: Any) -> None:
    e = smollm2_engine
    prompts = [e.tokenize("The capital of France is"), e.tokenize("def fibonacci(n):")]
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    outs = generate(e, {f"smol-lp-{i}": (p, params) for i, p in enumerate(prompts)})
    for out in outs.values():
        tokens = out.prompt_token_ids + out.output_token_ids
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)
        check_output(out, ref, params)
        assert out.logprobs is not None
        assert [x.token for x in out.logprobs] == [
            e.tokenizer.decode([t]) for t in out.output_token_ids
        ]


# ---- rows ---------------------------------------------------------------------------------


def overrides(**fields: Any) -> dict[str, Any]:
    row = parse_mapping({"prompt": "x", **fields}, 0, "line 1", ColumnSpec(), {})
    assert row.error is None, row.error
    return row.overrides


def batch_overrides(**body: Any) -> dict[str, Any] | str:
    obj = {
        "custom_id": "r",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], **body},
    }
    row = parse_mapping(obj, 0, "line 1", ColumnSpec(), {})
    return row.error if row.error is not None else row.overrides


def test_row_fields_map_onto_sampling_params() -> None:
    assert batch_overrides(logprobs=True, top_logprobs=3) == {"logprobs": 3}
    assert batch_overrides(logprobs=True) == {"logprobs": 0}
    assert batch_overrides(logprobs=False) == {"logprobs": None}
    assert batch_overrides(logprobs=True, top_logprobs=2, prompt_logprobs=1) == {
        "logprobs": 2,
        "prompt_logprobs": 1,
    }
    assert overrides(logprobs=4) == {"logprobs": 4}  # vLLM's integer
    assert overrides(logprobs=0, prompt_logprobs=0) == {"logprobs": 0, "prompt_logprobs": 0}
    assert overrides(logprobs=None, top_logprobs=None) == {}
    assert make_params(SamplingParams(), overrides(logprobs=True, top_logprobs=5)).logprobs == 5
    assert batch_overrides(top_logprobs=2) == "line 1: top_logprobs: needs logprobs: true"
    assert batch_overrides(logprobs=2, top_logprobs=2) == (
        "line 1: top_logprobs: goes with logprobs: true; with an integer logprobs give one or the other"
    )
    assert batch_overrides(logprobs="yes") == (
        "line 1: logprobs: must be true, false or an integer, got 'yes'"
    )
    with pytest.raises(RowError, match=r"logprobs: must be in \[0, 20\]"):
        make_params(SamplingParams(), overrides(logprobs=True, top_logprobs=21))
    with pytest.raises(RowError, match="prompt_logprobs: must be an integer"):
        make_params(SamplingParams(), overrides(prompt_logprobs=1.5))


# ---- cbgen run ----------------------------------------------------------------------------


def test_run_writes_the_logprob_columns(tmp_path: Path, chat_model: Path) -> None:
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "plain", "prompt": "Hello there"},
            {"id": "vllm", "prompt": "Hello there", "logprobs": 2, "prompt_logprobs": 1},
            {
                "custom_id": "openai",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "logprobs": True,
                    "top_logprobs": 3,
                },
            },
        ],
    )
    out = tmp_path / "out.parquet"
    done = run(["run", str(src), "-o", str(out), *tiny(chat_model), "--quiet"])
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in read_rows(out)}
    plain = rows["plain"]
    assert plain["logprobs"] is None and plain["prompt_logprobs"] is None
    assert plain["cumulative_logprob"] is None
    for rid, k in (("vllm", 2), ("openai", 3)):
        r = rows[rid]
        assert len(r["logprobs"]) == r["completion_tokens"] == 4
        for entry in r["logprobs"]:
            assert isinstance(entry["token"], str) and entry["logprob"] <= 0.0
            tops = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(tops) == k and tops == sorted(tops, reverse=True)
            assert entry["logprob"] <= tops[0]
        total = math.fsum(e["logprob"] for e in r["logprobs"])
        assert r["cumulative_logprob"] == pytest.approx(total, abs=1e-5)
    assert rows["openai"]["prompt_logprobs"] is None
    scored = rows["vllm"]["prompt_logprobs"]
    assert len(scored) == rows["vllm"]["prompt_tokens"] and scored[0] is None
    assert all(len(e["top_logprobs"]) == 1 for e in scored[1:])
