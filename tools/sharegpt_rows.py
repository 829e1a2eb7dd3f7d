"""The peer comparison's ShareGPT workload as `cbgen run` input: one JSONL row per request.

    python -m tools.sharegpt_rows sharegpt64.jsonl      # 64 requests, prompts <= 256, outputs <= 128
    cbgen run sharegpt64.jsonl -o out.parquet --temperature 0

The requests are tools.compare_peers's (build_workload: cbgen.bench.sharegpt, seed 0, the length
rules on the prompt before the chat template), drawn with the default model's tokenizer; a row
is the chat-templated prompt as token ids and the reply's token count as `max_tokens`, with
`ignore_eos` so that every run makes exactly those tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any


def sharegpt_rows(
    num_requests: int,
    max_output_len: int = 128,
    *,
    seed: int = 0,
    min_prompt_len: int = 4,
    max_prompt_len: int = 256,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The workload's rows and its counts (tools.compare_peers.workload_stats)."""
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer
    from tools.compare_peers import build_workload

    args = argparse.Namespace(
        num_requests=num_requests,
        seed=seed,
        min_prompt_len=min_prompt_len,
        max_prompt_len=max_prompt_len,
        max_output_len=max_output_len,
        exact_output_len=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(resolve_model(None)).save_pretrained(tmp)
        workload = Path(tmp) / "workload.json"
        stats = build_workload(Path(tmp), args, workload)
        requests = json.loads(workload.read_text())["requests"]
    rows = [
        {"id": r["id"], "prompt": r["prompt_token_ids"], "max_tokens": r["output_len"]}
        | {"ignore_eos": True}
        for r in requests
    ]
    return rows, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=4)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows, stats = sharegpt_rows(
        args.num_requests,
        args.max_output_len,
        seed=args.seed,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
    )
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{stats} -> {args.out}")


if __name__ == "__main__":
    main()
