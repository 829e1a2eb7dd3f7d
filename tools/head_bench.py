"""The LM head of a decode step two ways: the float32 head (the matmul a batch of its size takes,
then argmax) and the exact head this CPU has (int16 or bf16 logits with float32 recomputes,
cbgen.cpu.linear.ExactHead), on the model's head weight and hidden states of a real run (the
final hidden states of greedy chat replies to sample_data/prompts.jsonl). Per batch size the two
calls alternate, so a neighbour's burst falls on both; each time is the median of --reps calls,
the ratio the median of the reps' ratios. The tokens must agree.

    python -m tools.head_bench [--batch 1,8,64] [--reps 15] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cbgen.config import EngineConfig, SamplingParams
from cbgen.cpu.linear import ExactHead
from cbgen.engine.engine import Engine

PROMPTS = Path(__file__).resolve().parent.parent / "sample_data" / "prompts.jsonl"


class Recorder:
    """Stands in for the exact head during the run: keeps every hidden state it is given."""

    def __init__(self, head: ExactHead) -> None:
        self.head = head
        self.MIN_TEMPERATURE = head.MIN_TEMPERATURE
        self.rows: list[torch.Tensor] = []

    def __call__(
        self, hidden: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> torch.Tensor:
        self.rows.append(hidden.clone())
        return self.head(hidden, temperature, seeds)


def hidden_states(engine: Engine, head: ExactHead, need: int, max_tokens: int) -> torch.Tensor:
    """At least `need` final hidden states from greedy replies to the sample prompts (random
    token ids for a model without a tokenizer of its own vocabulary)."""
    runtime = engine.runtime
    recorder = Recorder(head)
    runtime.exact_head = recorder  # type: ignore[assignment]
    try:
        rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
        chats = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows]
        chats = [c for c in chats if all(isinstance(m.get("content"), str) for m in c)]
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        i = 0
        while sum(r.shape[0] for r in recorder.rows) < need:
            for chat in chats:
                ids = engine.apply_chat_template(chat) if engine.tokenizer is not None else []
                if not ids or max(ids) >= vocab:  # no tokenizer, or not this model's (dummy)
                    ids = torch.randint(0, vocab, (16,), generator=gen).tolist()
                engine.add_request(str(i), ids, params)
                i += 1
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        runtime.exact_head = head
    return torch.cat(recorder.rows)[:need]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length of the run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    args = ap.parse_args(argv)
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format=args.load_format,
            device="cpu",
            dtype="float32",
            kv_cache_memory=args.kv_cache_memory,
        )
    )
    model = engine.runner.model
    head = engine.runtime.exact_head
    if head is None:
        raise SystemExit(
            "this model and CPU have no exact LM head (the float32 head is all there is)"
        )
    batches = [int(b) for b in args.batch.split(",")]
    hidden = hidden_states(engine, head, max(batches), args.max_tokens)
    print(f"{type(head).__name__}: {head.DESCRIPTION}; head {list(model.head_weight.shape)}")
    print("| rows | float32 head (ms) | exact head (ms) | float32 / exact | most candidates |")
    print("|---|---|---|---|---|")
    for b in batches:
        h = hidden[:b].contiguous()
        zeros, seeds = torch.zeros(b), torch.zeros(b, dtype=torch.int64)
        want = model.compute_logits(h).argmax(-1)
        f32, exact, ratios, most = [], [], [], 0
        for _ in range(args.reps):
            t0 = time.perf_counter()
            model.compute_logits(h).argmax(-1)
            t1 = time.perf_counter()
            got = head(h, zeros, seeds)
            t2 = time.perf_counter()
            if not torch.equal(got, want):
                raise SystemExit(
                    f"batch {b}: the exact head's tokens differ from the float32 head's"
                )
            most = max(most, head.last_candidates)
            f32.append(1e3 * (t1 - t0))
            exact.append(1e3 * (t2 - t1))
            ratios.append((t1 - t0) / (t2 - t1))
        print(
            f"| {b} | {statistics.median(f32):.2f} | {statistics.median(exact):.2f} | "
            f"{statistics.median(ratios):.2f}x | {most} |"
        )


if __name__ == "__main__":
    main()
