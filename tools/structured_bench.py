"""Structured outputs' cost: the same ShareGPT rows with a JSON schema and without.

    python -m tools.structured_bench [--num-prompts 48] [--max-tokens 128] [--repeat 2]

One engine (SmolLM2-135M-Instruct by default) runs the rows three ways, in turns, each after a
warm-up: every row free (`free`), every row under the JSON schema below (`json`), and half of
each (`mixed`). Sampling at temperature 1, seeded per row; free rows ignore EOS, so they make
max_tokens tokens, while a constrained row stops when its JSON is complete. Throughput is
output tokens per second of the whole run, the best of --repeat rounds (on a shared machine
the fastest round is the one least disturbed). `grammar` is the share of the run spent filling
and applying masks and advancing matchers (timed inside the run, so other load cancels out).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.bench.sharegpt import sample_sharegpt
from cbgen.config import SamplingParams, StructuredOutputs
from cbgen.engine.engine import Engine
from cbgen.engine.structured import Grammars, GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
    },
    "required": ["topic", "summary", "keywords", "sentiment"],
}


GRAMMAR_S = [0.0]
"""Seconds spent in the grammar calls below (reset per run)."""


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_S[0] += time.perf_counter() - t0

    return wrapper


Grammars.apply = _timed(Grammars.apply)  # type: ignore[method-assign]
GrammarState.accept = _timed(GrammarState.accept)  # type: ignore[method-assign]


@dataclass
class Result:
    tokens: int
    seconds: float
    decode_steps: int
    decode_s: float
    grammar_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / max(self.decode_steps, 1)


def run(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], label: str
) -> Result:
    """Every prompt at once (ids prefixed by label: an id is not reused across runs)."""
    engine.reset_prefix_cache()
    GRAMMAR_S[0] = 0.0
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{label}-{i}", p, sp)
    tokens = steps = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        out = engine.step()
        s = out.stats
        tokens += sum(len(o.output_token_ids) for o in out.finished)
        if s.num_prefill_tokens == 0 and s.num_decode_tokens:
            steps += 1
            decode_s += s.duration_s
    return Result(tokens, time.perf_counter() - t0, steps, decode_s, GRAMMAR_S[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the three runs")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    engine = Engine(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=1 << 30,
        num_threads=args.threads,
    )
    print(engine.describe())
    tok = engine.tokenizer
    requests = sample_sharegpt(
        lambda text: engine.apply_chat_template([{"role": "user", "content": text}]),
        lambda text: len(tok.encode(text, add_special_tokens=False)),
        args.num_prompts,
        seed=0,
    )
    prompts = [r.prompt_token_ids for r in requests]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    spec = StructuredOutputs(json=SCHEMA)
    json_rows = [p.replace(ignore_eos=False, structured_outputs=spec) for p in free]
    mixed = [j if i % 2 else f for i, (f, j) in enumerate(zip(free, json_rows, strict=True))]
    cases = {"free": free, "json": json_rows, "mixed": mixed}
    run(
        engine, prompts[:4], free[:4], "warm-up"
    )  # warm-up (and the grammar compiled outside the timing)
    engine.grammars.compile(spec)
    results: dict[str, list[Result]] = {name: [] for name in cases}
    for round_ in range(args.repeat):
        for name, params in cases.items():
            results[name].append(run(engine, prompts, params, f"{name}{round_}"))
    print(
        f"{len(prompts)} ShareGPT prompts, max_tokens {args.max_tokens}, threads {torch.get_num_threads()}"
    )
    print(f"{'rows':6} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'step ms':>8} {'grammar':>8}")
    best = {name: max(rs, key=lambda r: r.tokens_per_s) for name, rs in results.items()}
    for name, rs in results.items():
        for r in rs:
            print(
                f"{name:6} {r.tokens:7d} {r.seconds:8.2f} {r.tokens_per_s:9.1f} "
                f"{r.step_ms:8.1f} {r.grammar_s / r.seconds:8.1%}"
            )
    ratio = best["json"].tokens_per_s / best["free"].tokens_per_s
    print(f"json / free tokens/s (best of {args.repeat}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
