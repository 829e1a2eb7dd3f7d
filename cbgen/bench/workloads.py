"""Benchmark workloads: a list of requests, each a prompt (token ids) and an exact output length.

Every request is run with ignore_eos and max_tokens = output_len, so two runs of one workload
compute the same tokens whatever the model says, and policies compare like for like.

  sharegpt  real conversations (see sharegpt.py)
  random    random token ids, lengths uniform in [L(1 - r), L(1 + r)]
  file      JSONL rows: prompt (text or chat messages) or prompt_token_ids, and output_len
  prefix    a few long shared prefixes, each followed by a short private suffix
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


Encode = Callable[[Any], list[int]]
"""Text, or a list of chat messages, to prompt token ids."""


def _uniform_lens(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Prompts of random token ids; input and output lengths each uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if input_len < 1 or output_len < 1:
        raise ValueError(
            f"input_len and output_len: must be >= 1, got {input_len} and {output_len}"
        )
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _uniform_lens(rng, input_len, range_ratio, num_prompts)
    out_lens = _uniform_lens(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(f"random-{i}", [int(t) for t in rng.integers(0, vocab_size, size=n_in)], n_out)
        for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens, strict=True))
    ]


def prefix_workload(
    num_prompts: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """num_prompts requests over num_prefixes random prefixes of prefix_len tokens, taken in
    turn (request i uses prefix i mod num_prefixes), each with its own random suffix of
    suffix_len tokens. Only the prefixes can be served from the cache."""
    if min(prefix_len, num_prefixes, suffix_len, output_len) < 1:
        raise ValueError("prefix_len, num_prefixes, suffix_len and output_len: must all be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [
        [int(t) for t in rng.integers(0, vocab_size, size=prefix_len)] for _ in range(num_prefixes)
    ]
    return [
        BenchRequest(
            f"prefix-{i}",
            prefixes[i % num_prefixes]
            + [int(t) for t in rng.integers(0, vocab_size, size=suffix_len)],
            output_len,
        )
        for i in range(num_prompts)
    ]


def file_workload(path: str | Path, encode: Encode, num_prompts: int | None) -> list[BenchRequest]:
    """JSONL rows with `prompt` (text or a list of chat messages) or `prompt_token_ids`, and
    `output_len`; an `id` or `custom_id` names the request (else the row index)."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_prompts is not None and len(out) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            out.append(_file_row(row, encode, f"{path}:{lineno}", len(out)))
    return out


def _file_row(row: Any, encode: Encode, where: str, index: int) -> BenchRequest:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    output_len = row.get("output_len")
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f"{where}: output_len must be an integer >= 1, got {output_len!r}")
    if "prompt_token_ids" in row:
        ids = row["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
    elif isinstance(row.get("prompt"), (str, list)):
        ids = encode(row["prompt"])
    else:
        raise ValueError(f"{where}: a row needs prompt (text or messages) or prompt_token_ids")
    rid = row.get("id", row.get("custom_id", index))
    return BenchRequest(str(rid), list(ids), output_len)


def fold_into_vocab(requests: Sequence[BenchRequest], vocab_size: int) -> list[BenchRequest]:
    """Token ids modulo vocab_size: lets a dummy shape whose vocabulary is smaller than the
    tokenizer's run a text workload with the same lengths."""
    return [
        BenchRequest(r.request_id, [t % vocab_size for t in r.prompt_token_ids], r.output_len)
        for r in requests
    ]


def poisson_arrivals(n: int, request_rate: float | None, seed: int) -> list[float]:
    """Arrival offsets in seconds: all 0 when request_rate is None (or infinite); otherwise a
    Poisson process: the first request at 0, then gaps drawn i.i.d. from Exp(request_rate)
    by numpy's default_rng(seed)."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be > 0, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]
