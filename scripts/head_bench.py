"""Time SmolLM2's LM head (49,152 x 576) on hidden states from real decode steps: the float32
logits through small_gemm followed by the sampler's C kernel or an argmax (the float32 path),
against the bf16 head (bf16 logits through oneDNN, then the exact argmax or the exact draw by
rejection; cbgen/attention/csrc/bf16_head.c).

python scripts/head_bench.py [--rows 8,64] [--repeats 9] [--temperature 1]

The hidden states come from a few decode steps of 64 random prompts. Before each timed call a
256 MB buffer is rewritten so that the head's weights come from memory, as they do in a
decode step. Prints the median milliseconds a call.
"""

from __future__ import annotations

import argparse
import random

import torch
from timing import median_time  # scripts/timing.py (this folder is on sys.path)

from cbgen.attention import native
from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine
from cbgen.models.llama import bf16_matmul_fast


def decode_hidden(engine: Engine, steps: int) -> torch.Tensor:
    """The final hidden states the runner samples from, over `steps` decode steps of 64
    requests."""
    runner = engine.runner
    seen: list[torch.Tensor] = []
    inner = runner._sample

    def capture(hidden: torch.Tensor, rows: list) -> list[int]:
        seen.append(hidden.clone())
        return inner(hidden, rows)

    runner._sample = capture  # type: ignore[method-assign]
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(64):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 200))]
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    runner._sample = inner  # type: ignore[method-assign]
    return torch.cat([h for h in seen if h.shape[0] == 64])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    if native.load_library() is None:
        raise SystemExit("no C compiler: small_gemm is unavailable")
    if not bf16_matmul_fast():
        raise SystemExit("this CPU has no native bfloat16 matmul: the bf16 head is not used here")
    engine = Engine(EngineConfig(max_num_seqs=64))
    model, head = engine.runner.model, engine.runner.model.bf16_head
    assert head is not None
    hidden_all = decode_hidden(engine, 8)
    flush = torch.zeros(64 << 20)

    def cold() -> None:
        flush.add_(1.0)

    for m in (int(r) for r in args.rows.split(",")):
        hidden = hidden_all[:m].contiguous()
        temp = torch.full((m,), args.temperature)
        seeds = torch.arange(m)
        u = torch.rand(m)
        calls = {
            "float32 logits + draw": lambda _, h=hidden, t=temp, u=u: native.sample(model.compute_logits(h), t, u),
            "bf16 head draw": lambda _, h=hidden, t=temp, s=seeds: head(h, t, s),
            "float32 logits + argmax": lambda _, h=hidden: model.compute_logits(h).argmax(-1),
            "bf16 head argmax": lambda _, h=hidden, t=temp, s=seeds: head(h, torch.zeros_like(t), s),
        }
        times = [f"{name} {median_time(fn, args.repeats, setup=cold) * 1e3:6.2f} ms" for name, fn in calls.items()]
        print(f"{m:3d} rows: " + ", ".join(times))


if __name__ == "__main__":
    main()
