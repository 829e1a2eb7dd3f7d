"""--output-format jsonl | openai: the run's Parquet record exported as JSON lines at the end,
atomically; resuming and sharding work as for Parquet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from helpers.cli import run, tiny, write_jsonl

from cbgen.io.export import resolve_format

ROWS = [
    {
        "id": "c",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
    },
    {"id": "p", "prompt": "Once upon a time"},
    {"id": "bad", "prompt": "x", "top_p": 3},
]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_format_follows_the_output_name() -> None:
    assert resolve_format("auto", "out.jsonl") == "jsonl"
    assert resolve_format("auto", "out.parquet") == "parquet"
    assert resolve_format("auto", None) == "parquet"
    assert resolve_format("openai", "x.jsonl") == "openai"
    with pytest.raises(ValueError, match="--output-format: must be one of"):
        resolve_format("csv", None)


def test_jsonl_output_holds_every_row_and_resumes(tmp_path: Path, chat_model: Path) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "res.jsonl"
    args = ["run", str(src), "-o", str(out), *tiny(chat_model)]
    done = run(args)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"3 lines written to {out} (jsonl)" in done.stdout
    lines = {r["id"]: r for r in _lines(out)}
    record = {r["id"]: r for r in pq.read_table(tmp_path / "res.parquet").to_pylist()}
    assert lines.keys() == record.keys() == {"c", "p", "bad"}
    for key in lines:
        assert lines[key]["completion"] == record[key]["completion"]
        assert lines[key]["finish_reason"] == record[key]["finish_reason"]
    assert lines["c"]["request_kind"] == "chat" and len(lines["c"]["logprobs"]) == 4
    assert lines["bad"]["error"].startswith("line 3: top_p")
    assert not list(tmp_path.glob(".res.jsonl.tmp-*"))
    again = run(args)  # resumes from the record: nothing to do, the same lines
    assert again.returncode == 0 and "resumed 3" in again.stdout
    assert {r["id"]: r["completion"] for r in _lines(out)} == {
        k: v["completion"] for k, v in lines.items()
    }


def test_openai_batch_output_lines(tmp_path: Path, chat_model: Path) -> None:
    src = write_jsonl(tmp_path / "p.jsonl", ROWS)
    out = tmp_path / "batch_output.jsonl"
    done = run(["run", str(src), "-o", str(out), "--output-format", "openai", *tiny(chat_model)])
    assert done.returncode == 0, done.stderr + done.stdout
    lines = {r["custom_id"]: r for r in _lines(out)}
    chat = lines["c"]["response"]
    assert chat["status_code"] == 200 and lines["c"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == chat_model.name
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["logprob"] <= 0
    text = lines["p"]["response"]["body"]
    assert text["object"] == "text_completion" and isinstance(text["choices"][0]["text"], str)
    assert text["choices"][0]["logprobs"] is None
    bad = lines["bad"]["response"]
    assert bad["status_code"] == 400
    assert bad["body"]["error"]["type"] == "invalid_request_error"
    assert bad["body"]["error"]["message"].startswith("line 3: top_p")


def test_shards_export_their_own_parts(tmp_path: Path, chat_model: Path) -> None:
    src = write_jsonl(
        tmp_path / "p.jsonl", [{"id": str(i), "prompt": [5, 6, 7 + i]} for i in range(6)]
    )
    folder = tmp_path / "parts"
    for k in range(2):
        done = run(
            [
                "run",
                str(src),
                "-o",
                str(folder),
                "--output-format",
                "jsonl",
                "--shard",
                f"{k}/2",
                *tiny(chat_model),
            ]
        )
        assert done.returncode == 0, done.stderr + done.stdout
    parts = sorted(folder.glob("*.jsonl"))
    assert [p.name for p in parts] == ["part-00000-of-00002.jsonl", "part-00001-of-00002.jsonl"]
    ids = sorted(r["id"] for p in parts for r in _lines(p))
    assert ids == [str(i) for i in range(6)]
