"""--output-format jsonl | openai: the finished Parquet file exported as JSON lines, atomically
(written beside, fsynced, renamed), after the run. The Parquet file stays as the run's record
(resume keys, settings, the summary's figures), so a JSONL output resumes like a Parquet one.

    jsonl    one object per output row, the Parquet columns as they are
    openai   one OpenAI Batch API output line per output row: {id, custom_id, response:
             {status_code, request_id, body}, error}, the body a chat.completion (rows with
             messages) or a text_completion with usage (and logprobs in OpenAI's shape when the
             row asked); a failed row gets status 400 and OpenAI's error body. A row with n > 1
             gives n lines, its choice's index being the sample index.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("auto", "parquet", "jsonl", "openai")


def resolve_format(requested: str, output: str | None) -> str:
    """auto: jsonl when OUTPUT ends in .jsonl, else parquet."""
    if requested not in FORMATS:
        raise ValueError(f"--output-format: must be one of {', '.join(FORMATS)}; got {requested!r}")
    if requested != "auto":
        return requested
    return "jsonl" if output is not None and output.endswith(".jsonl") else "parquet"


def export(record: Path, target: Path, fmt: str, model: str) -> int:
    """Write `target` from the Parquet file `record`; returns the lines written."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            n = write_lines(record, f.write, fmt, model)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_lines(
    record: Path | pa.NativeFile, write: Callable[[bytes], Any], fmt: str, model: str
) -> int:
    """The export's lines from the Parquet file `record` (a path or an open file), UTF-8,
    handed to `write`; returns how many."""
    created = int(time.time())
    n = 0
    for rec in _records(record):
        line = rec if fmt == "jsonl" else openai_line(rec, model, created)
        write((json.dumps(line, ensure_ascii=False, default=str) + "\n").encode())
        n += 1
    return n


def _records(path: Path | pa.NativeFile) -> Iterator[dict[str, Any]]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def openai_line(rec: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    request_id = f"req_{rec['row']}_{rec['sample_index']}"
    line: dict[str, Any] = {"id": f"batch_{request_id}", "custom_id": rec["id"], "error": None}
    if rec["finish_reason"] == "error":
        body: dict[str, Any] = {
            "error": {
                "message": rec["error"],
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        line["response"] = {"status_code": 400, "request_id": request_id, "body": body}
        return line
    chat = rec.get("request_kind") == "chat"
    choice: dict[str, Any] = {"index": rec["sample_index"], "finish_reason": rec["finish_reason"]}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": rec["completion"]}
        if rec.get("reasoning") is not None:
            message["reasoning_content"] = rec["reasoning"]
        choice["message"] = message
        choice["logprobs"] = _chat_logprobs(rec.get("logprobs"))
    else:
        choice["text"] = rec["completion"]
        choice["logprobs"] = _text_logprobs(rec.get("logprobs"))
    prompt, completion = rec["prompt_tokens"] or 0, rec["completion_tokens"] or 0
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def _chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

    return {
        "content": [
            dict(one(e), top_logprobs=[one(t) for t in e.get("top_logprobs") or []])
            for e in entries
        ]
    }


def _text_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries
        ],
        "text_offset": None,
    }
