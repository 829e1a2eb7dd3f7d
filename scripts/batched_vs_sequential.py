"""Throughput of one LLM.generate call over N ShareGPT requests versus the same requests one
at a time, on the same engine (SmolLM2-135M-Instruct, fp32, CPU by default).

    python scripts/batched_vs_sequential.py --num-prompts 64 --max-prompt-len 256 --max-output-len 128

Every request generates exactly its ShareGPT reply length (capped; ignore_eos), so both runs
compute the same tokens. Prints tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from cbgen import LLM, SamplingParams
from cbgen.bench.sharegpt import sample_sharegpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()

    llm = LLM(max_num_seqs=args.max_num_seqs, dtype="float32")
    engine = llm.engine
    reqs = sample_sharegpt(
        lambda text: engine.apply_chat_template([{"role": "user", "content": text}]),
        lambda text: len(engine.tokenize(text)),
        args.num_prompts,
        args.seed,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
    )
    prompts = [r.prompt_token_ids for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    tokens = sum(r.prompt_len + r.output_len for r in reqs)
    out_tokens = sum(r.output_len for r in reqs)
    llm.generate([prompts[0]], [SamplingParams(temperature=0, max_tokens=4)])  # warm-up

    t0 = time.perf_counter()
    batched = llm.generate(prompts, params)
    t_batched = time.perf_counter() - t0

    t0 = time.perf_counter()
    sequential = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    t_seq = time.perf_counter() - t0

    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(batched, sequential, strict=True))
    result = {
        "requests": len(reqs),
        "prompt_tokens": tokens - out_tokens,
        "output_tokens": out_tokens,
        "batched_s": round(t_batched, 2),
        "sequential_s": round(t_seq, 2),
        "batched_total_tokens_per_s": round(tokens / t_batched, 1),
        "sequential_total_tokens_per_s": round(tokens / t_seq, 1),
        "speedup": round(t_seq / t_batched, 2),
        "identical_outputs": f"{same}/{len(reqs)}",
        "machine": f"{platform.processor() or platform.machine()}, {engine.describe()}",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
