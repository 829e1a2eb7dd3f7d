"""The output table: one row per (input row, sample), failed rows included.

    id | row | sample_index | prompt_tokens | cached_tokens | completion | reasoning |
    completion_tokens |
    finish_reason | stop_reason | error | request_kind | queue_s | ttft_s | tpot_s | itl_p50_s | itl_p99_s |
    itl_max_s | e2e_s | num_preemptions | cumulative_logprob | logprobs | prompt_logprobs |
    <pass-through columns>

Latencies are seconds on one monotonic clock (time.perf_counter), measured from the moment
the request entered the engine; for a successful row 0 <= queue_s <= ttft_s <= e2e_s.
The logprob columns are null unless the row asked for them. `reasoning` holds a thinking
model's reasoning (the text before its end tag, e.g. </think>), and `completion` the answer
after it; null for models without reasoning tags and for completions without the end tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from cbgen.engine.logprobs import TokenLogprob
from cbgen.engine.outputs import RequestOutput
from cbgen.io.rows import InputRow

LATENCY_COLUMNS = ("queue_s", "ttft_s", "tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s", "e2e_s")
LOGPROB_COLUMNS = ("cumulative_logprob", "logprobs", "prompt_logprobs")

_TOP_LOGPROB = pa.struct(
    [("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())]
)
TOKEN_LOGPROB = pa.struct([*_TOP_LOGPROB, ("top_logprobs", pa.list_(_TOP_LOGPROB))])
"""One token's entry: the token, its logprob and the top entries, best first."""

BASE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("id", pa.string(), nullable=False),
    pa.field("row", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("cached_tokens", pa.int32()),
    pa.field("completion", pa.string()),
    pa.field("reasoning", pa.string()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("stop_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("request_kind", pa.string()),
    *(pa.field(c, pa.float64()) for c in LATENCY_COLUMNS),
    pa.field("num_preemptions", pa.int32()),
    pa.field("cumulative_logprob", pa.float64()),
    pa.field("logprobs", pa.list_(TOKEN_LOGPROB)),
    pa.field("prompt_logprobs", pa.list_(TOKEN_LOGPROB)),
)
BASE_NAMES = frozenset(f.name for f in BASE_FIELDS)


def output_schema(keep_types: Mapping[str, pa.DataType]) -> pa.Schema:
    """The base columns, then the pass-through columns in the order given."""
    clash = sorted(BASE_NAMES & set(keep_types))
    if clash:
        raise ValueError(
            f"keep_columns: {', '.join(clash)} would clash with output columns of the same name"
        )
    return pa.schema([*BASE_FIELDS, *(pa.field(n, t) for n, t in keep_types.items())])


def split_reasoning(text: str, tags: tuple[str, str] | None) -> tuple[str | None, str]:
    """(reasoning, answer): what comes before the end tag (less a leading start tag; the chat
    template may have put that in the prompt) and what follows it. Without the end tag the
    text is all answer, as it was generated."""
    if tags is None or tags[1] not in text:
        return None, text
    start, end = tags
    reasoning, _, answer = text.partition(end)
    reasoning = reasoning.strip()
    return reasoning.removeprefix(start).strip(), answer.lstrip()


def ok_record(
    row: InputRow,
    sample_index: int,
    out: RequestOutput,
    reasoning_tags: tuple[str, str] | None = None,
) -> dict[str, Any]:
    m = out.metrics
    reasoning, answer = split_reasoning(out.text, reasoning_tags)
    rec: dict[str, Any] = {
        "id": row.id,
        "row": row.row,
        "sample_index": sample_index,
        "prompt_tokens": out.num_prompt_tokens,
        "cached_tokens": out.num_cached_tokens,
        "completion": answer,
        "reasoning": reasoning,
        "completion_tokens": out.num_output_tokens,
        "finish_reason": out.finish_reason,
        "stop_reason": None if out.stop_reason is None else str(out.stop_reason),
        "error": out.error,
        "request_kind": _kind(row),
        "queue_s": m.queue_s,
        "ttft_s": m.ttft_s,
        "tpot_s": m.tpot_s,
        "itl_p50_s": m.itl_p50_s,
        "itl_p99_s": m.itl_p99_s,
        "itl_max_s": m.itl_max_s,
        "e2e_s": m.e2e_s,
        "num_preemptions": out.num_preemptions,
        "cumulative_logprob": out.cumulative_logprob,
        "logprobs": _entries(out.logprobs),
        "prompt_logprobs": _entries(out.prompt_logprobs),
    }
    rec.update(row.keep)
    return rec


def _entries(logprobs: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
    """TOKEN_LOGPROB values (None stays None: the first prompt token has no logprob)."""
    if logprobs is None:
        return None
    return [
        None
        if e is None
        else {
            "token_id": e.token_id,
            "token": e.token,
            "logprob": e.logprob,
            "top_logprobs": [
                {"token_id": t.token_id, "token": t.token, "logprob": t.logprob}
                for t in e.top_logprobs
            ],
        }
        for e in logprobs
    ]


def error_record(
    row: InputRow, message: str, prompt_tokens: int | None = None, sample_index: int = 0
) -> dict[str, Any]:
    """A failed row: finish_reason 'error', the message, no completion and no latencies."""
    rec: dict[str, Any] = {
        "id": row.id,
        "row": row.row,
        "sample_index": sample_index,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": 0,
        "completion": None,
        "completion_tokens": 0,
        "finish_reason": "error",
        "stop_reason": None,
        "error": message,
        "request_kind": _kind(row),
        **dict.fromkeys(LATENCY_COLUMNS),
        "num_preemptions": 0,
        **dict.fromkeys(LOGPROB_COLUMNS),
    }
    rec.update(row.keep)
    return rec


def _kind(row: InputRow) -> str:
    """chat (the row gave messages) or completion (a prompt, or nothing usable)."""
    return "chat" if row.messages is not None else "completion"
