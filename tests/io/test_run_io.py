"""`cbgen run` building blocks, in-process and exact: row parsing, shards, sizes, the staging
streams and their crash tolerance, resume keys, the atomic finalize, the status line, and
the generation loop's bounded feeding of a real (tiny) engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbgen.config import parse_size
from cbgen.display import LogDisplay, ProgressSnapshot, format_status
from cbgen.io.parse import make_params, parse_json_line
from cbgen.io.rows import ColumnSpec, InputRow, RowError
from cbgen.io.schema import error_record, output_schema
from cbgen.io.shard import RowFilter, Shard
from cbgen.io.writer import (
    KeySet,
    OutputError,
    OutputLayout,
    StagingWriter,
    check_compatible,
    finalize,
    load_done_keys,
    read_stream,
    row_key,
)
from cbgen.sampling_params import SamplingParams

SPEC = ColumnSpec()


def parse(obj: Any, spec: ColumnSpec = SPEC, row: int = 4, lineno: int = 7) -> InputRow:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_json_line(raw, row, lineno, spec)


# ---- sizes, shards, filters ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("512mib", 512 << 20),
        ("2GB", 2 * 10**9),
        ("1000", 1000),
        ("1.5KiB", 1536),
        ("8M", 8 << 20),
        (" 3 GiB ", 3 << 30),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "4 gigs", "-1", "0", "1e9", "4GiBs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size(text)


def test_shard_parse_and_slurm() -> None:
    assert Shard.parse("3/8") == Shard(3, 8)
    for bad in ("3", "8/3", "a/b", "1/0", "-1/4"):
        with pytest.raises(ValueError, match="shard"):
            Shard.parse(bad)
    assert Shard.from_slurm({}) is None
    assert Shard.from_slurm({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}) == Shard(
        2, 4
    )
    # --array=1-4 and --array=0-14:2 map onto 0..N-1
    env = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}
    assert Shard.from_slurm(env) == Shard(3, 4)
    env = {
        "SLURM_ARRAY_TASK_ID": "14",
        "SLURM_ARRAY_TASK_COUNT": "8",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_STEP": "2",
    }
    assert Shard.from_slurm(env) == Shard(7, 8)
    with pytest.raises(ValueError, match="outside"):
        Shard.from_slurm({"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "3"})
    assert Shard(3, 8).label == "part-00003-of-00008"


def test_row_filter_split_partitions_the_shard() -> None:
    shard = Shard(1, 3).filter
    rows = range(1000)
    owned = [r for r in rows if shard(r)]
    parts = [shard.split(4, k) for k in range(4)]
    got = sorted(r for p in parts for r in rows if p(r))
    assert got == owned  # every row of the shard goes to exactly one worker
    assert [p.count(1000) for p in parts] == [sum(1 for r in rows if p(r)) for p in parts]
    assert RowFilter(3, 2).count(2) == 0 and RowFilter(3, 2).count(3) == 1


# ---- rows ------------------------------------------------------------------------------------


def test_plain_prompt_row() -> None:
    r = parse({"id": 12, "prompt": "hello", "max_tokens": 5, "stop": "x", "note": 1})
    assert (r.row, r.id, r.prompt, r.messages, r.error) == (4, "12", "hello", None, None)
    assert r.overrides == {"max_tokens": 5, "stop": "x"}
    assert parse({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse({"prompt": "x"}).id == "4"  # no id: the row index
    assert parse({"id": 1.5, "prompt": "x"}).id == "1.5"
    assert parse({"prompt": "x", "temperature": None}).overrides == {}  # null means the default


def test_chat_row_and_content_parts() -> None:
    r = parse(
        {
            "id": "c",
            "messages": [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert r.error is None
    assert r.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]


def test_openai_batch_rows() -> None:
    chat = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "user": "u",
        },
    }
    r = parse(chat)
    assert (r.id, r.messages, r.overrides, r.error) == (
        "req-1",
        [{"role": "user", "content": "hi"}],
        {"temperature": 0.5, "max_tokens": 9},
        None,
    )
    comp = {
        "custom_id": "req-2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "abc", "seed": 3},
    }
    r = parse(comp)
    assert (r.id, r.prompt, r.overrides) == ("req-2", "abc", {"seed": 3})
    r = parse({"custom_id": "req-3", "url": "/v1/embeddings", "body": {"input": "x"}})
    assert r.id == "req-3"
    assert (
        r.error
        == "line 7: url: '/v1/embeddings' is not supported (use /v1/chat/completions or /v1/completions)"
    )
    r = parse({"custom_id": "req-4", "url": "/v1/chat/completions", "body": {"prompt": "x"}})
    assert r.error == "line 7: body: /v1/chat/completions needs a 'messages' field"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            b"{not json",
            "line 7: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
        ),
        (b'{"prompt": "\xff"}', "line 7: is not valid UTF-8 (byte 13)"),
        ([1, 2], "line 7: expected a JSON object, got list"),
        (
            {"id": "a"},
            "line 7: no prompt: give a 'prompt' (text or token ids) or 'messages' (chat) field",
        ),
        ({"prompt": 5}, "line 7: prompt: must be a string or a list of token ids, got 5"),
        ({"prompt": ""}, "line 7: prompt: is empty"),
        ({"prompt": ["a", "b"]}, "line 7: prompt: a list of 2 prompts; give one prompt per row"),
        (
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            "line 7: give either 'prompt' or 'messages', not both",
        ),
        (
            {"messages": []},
            "line 7: messages: must be a non-empty list of {role, content} objects, got []",
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "line 7: messages[0].role: unknown role 'robot' (expected system, user, assistant, tool)",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "line 7: messages[0].content: must be a string, got 3",
        ),
        ({"id": [1], "prompt": "x"}, "line 7: id: must be a string or a number, got [1]"),
        ({"id": True, "prompt": "x"}, "line 7: id: must be a string or a number, got true"),
    ],
)
def test_bad_rows_name_the_problem_and_line(obj: Any, message: str) -> None:
    r = parse(obj)
    assert r.error == message
    assert r.row == 4


def test_error_row_keeps_a_valid_id() -> None:
    assert parse({"id": "keep-me", "messages": "nope"}).id == "keep-me"
    assert parse({"id": 7, "prompt": 1}).id == "7"


def test_columns_spec() -> None:
    spec = ColumnSpec(prompt_column="text", id_column="key", keep_columns=("meta", "n_words"))
    r = parse({"key": "k1", "text": "hello", "meta": {"a": 1}, "n_words": 2}, spec)
    assert (r.id, r.prompt, r.keep) == ("k1", "hello", {"meta": '{"a": 1}', "n_words": "2"})
    r = parse({"key": "k2", "text": [{"role": "user", "content": "x"}]}, spec)
    assert r.messages == [{"role": "user", "content": "x"}] and r.keep == {
        "meta": None,
        "n_words": None,
    }
    assert (
        parse({"key": "k3"}, spec).error == "line 7: no prompt: the 'text' field is missing or null"
    )


def test_make_params() -> None:
    defaults = SamplingParams(max_tokens=8, temperature=0.0)
    assert make_params(defaults, {}) is defaults
    p = make_params(defaults, {"max_tokens": 3, "stop": "\n"})
    assert (p.max_tokens, p.temperature, p.stop) == (3, 0.0, ["\n"])
    with pytest.raises(RowError, match=r"^top_p: must be in \(0, 1\], got 2$"):
        make_params(defaults, {"top_p": 2})
    with pytest.raises(RowError, match=r"^max_tokens: must be an integer, got '3'$"):
        make_params(defaults, {"max_tokens": "3"})


# ---- staging, keys, finalize -----------------------------------------------------------------


SCHEMA = output_schema({})


def _rec(i: int, sample: int = 0) -> dict[str, Any]:
    return error_record(
        InputRow(i, f"line {i + 1}", f"id-{i}"), f"problem {i}", sample_index=sample
    )


def _write_stream(staging: Path, tag: str, batches: list[list[int]]) -> Path:
    w = StagingWriter(staging, SCHEMA, tag)
    for batch in batches:
        for i in batch:
            w.add(_rec(i))
        w.flush()
    w.close()
    return w.path


def test_read_stream_survives_truncation_anywhere(tmp_path: Path) -> None:
    path = _write_stream(tmp_path, "s", [[0, 1], [2], [3, 4, 5]])
    data = path.read_bytes()
    assert [r["id"] for b in read_stream(path) for r in b.to_pylist()] == [
        f"id-{i}" for i in range(6)
    ]
    cut = tmp_path / "cut.arrows"
    seen = []
    for n in [*range(0, len(data), 5), len(data) - 1, len(data)]:
        cut.write_bytes(data[:n])
        ids = [r["id"] for b in read_stream(cut) for r in b.to_pylist()]
        assert ids == [f"id-{i}" for i in range(len(ids))]  # always a prefix, never garbage
        seen.append(len(ids))
    assert seen == sorted(seen) and set(seen) == {0, 2, 3, 6}


def test_keyset_is_exact_for_keys_with_trailing_nul_bytes() -> None:
    a = b"\x01" * 15 + b"\x00"
    b = b"\x01" * 15 + b"\x02"
    c = b"\x01" * 14 + b"\x00\x00"
    ks = KeySet(np.array([a, b], dtype="S16"))
    assert a in ks and b in ks and c not in ks and b"\x00" * 16 not in ks
    assert ks.contains_many(np.array([c, b, a], dtype="S16")).tolist() == [False, True, True]
    assert row_key("x", 0) != row_key("x", 1) != row_key("x\x1f0", 0)
    assert len(row_key("x", 0)) == 16


def _layout(tmp_path: Path) -> OutputLayout:
    layout = OutputLayout.build(str(tmp_path / "in.jsonl"), None, None)
    layout.prepare()
    return layout


def test_layouts(tmp_path: Path) -> None:
    layout = OutputLayout.build("data/p.jsonl", None, None)
    assert (str(layout.final), str(layout.summary), str(layout.staging)) == (
        "data/p.out.parquet",
        "data/p.out.summary.json",
        "data/p.out.partial",
    )
    layout = OutputLayout.build("p.jsonl", "res/out.parquet", Shard(2, 4))
    assert (str(layout.final), str(layout.summary), str(layout.staging)) == (
        "res/out.parquet/part-00002-of-00004.parquet",
        "res/out.parquet/_part-00002-of-00004.summary.json",
        "res/out.parquet/_part-00002-of-00004.partial",
    )
    with pytest.raises(OutputError, match="stdin"):
        OutputLayout.build("-", None, None)
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="is a file"):
        OutputLayout.build("p.jsonl", str(tmp_path / "f"), Shard(0, 2))
    with pytest.raises(OutputError, match="output folder"):
        OutputLayout.build("p.jsonl", str(tmp_path / "f" / "o.parquet"), None).prepare()


def test_resume_keys_and_finalize_after_a_crash_mid_finalize(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    _write_stream(layout.staging, "run-1", [[0, 1, 2], [3]])
    assert {row_key(f"id-{i}", 0) for i in range(4)} == {
        bytes(k) for k in load_done_keys(layout).keys
    }
    assert finalize(layout, SCHEMA) == 4
    assert not layout.staging.exists()
    assert sorted(pq.read_table(layout.final).column("id").to_pylist()) == [
        f"id-{i}" for i in range(4)
    ]
    # A finalize that died after the rename but before removing the staging folder, and a
    # later run that added rows 4 and 5: the final file must hold each row once.
    layout.prepare()
    _write_stream(layout.staging, "run-1", [[0, 1, 2], [3]])
    _write_stream(layout.staging, "run-2", [[4, 5]])
    assert len(load_done_keys(layout)) == 6
    assert finalize(layout, SCHEMA) == 6
    ids = pq.read_table(layout.final).column("id").to_pylist()
    assert sorted(ids) == [f"id-{i}" for i in range(6)]
    assert not list(tmp_path.glob(".*tmp*"))


def test_finalize_rechunks_small_batches_into_few_row_groups(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    _write_stream(layout.staging, "run-1", [[i] for i in range(300)])
    assert finalize(layout, SCHEMA) == 300
    assert pq.ParquetFile(layout.final).metadata.num_row_groups == 1


def test_incompatible_earlier_results_are_refused(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    _write_stream(layout.staging, "run-1", [[0]])
    check_compatible(layout, SCHEMA)
    with pytest.raises(OutputError, match="--keep-columns"):
        check_compatible(layout, output_schema({"topic": pa.string()}))
    with pytest.raises(ValueError, match="clash"):
        output_schema({"error": pa.string()})


# ---- display ---------------------------------------------------------------------------------


def _snap(**kw: Any) -> ProgressSnapshot:
    base = dict(
        elapsed_s=65.0,
        rows_done=1200,
        rows_total=10000,
        rows_failed=3,
        rows_resumed=0,
        rows_per_s=45.2,
        running=60,
        max_num_seqs=64,
        waiting=128,
        kv_blocks_used=713,
        kv_blocks_total=1000,
        preemptions=4,
        prefill_tok_s=1520.0,
        decode_tok_s=900.0,
        prompt_tokens=800,
        cached_tokens=100,
        completion_tokens=50,
    )
    base.update(kw)
    return ProgressSnapshot(**base)


def test_status_line() -> None:
    assert format_status(_snap()) == (
        "[cbgen 1m05s] rows 1200/10000 12.0% (3 failed, 0 resumed) 45.2 rows/s ETA 3m15s | slots 60/64 "
        "waiting 128 | kv 71.3% | preemptions 4 | prefill 1520 tok/s decode 900 tok/s | cache hit 12.5%"
    )
    assert "rows 7 (" in format_status(_snap(rows_done=7, rows_total=None))
    both = ProgressSnapshot.combine([_snap(), _snap(rows_total=None)], 5.0)
    assert (both.rows_done, both.rows_total, both.max_num_seqs, both.elapsed_s) == (
        2400,
        None,
        128,
        5.0,
    )
    both = ProgressSnapshot.combine([_snap(), _snap()], 5.0)
    assert (both.rows_total, both.kv_usage, both.cache_hit_rate) == (20000, 0.713, 0.125)


def test_log_display_rate_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    clock = [100.0]
    monkeypatch.setattr("cbgen.display.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    d = LogDisplay(10.0, out)
    for t in range(0, 35):
        clock[0] = 100.0 + t
        d.update(_snap())
    assert out.getvalue().count("\n") == 3  # at 10, 20, 30 seconds
    d.stop(_snap())
    assert out.getvalue().count("\n") == 4


# ---- the loop against a real tiny engine ------------------------------------------------------


def test_loop_feeds_as_slots_free_up(tmp_path: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    """The reader is pulled lazily: when the first requests finish only queue_depth rows have
    been read, and the engine never holds more than queue_depth requests."""
    from cbgen.display import Display
    from cbgen.engine.engine import Engine
    from cbgen.io.pipeline import GenerationLoop
    from cbgen.io.progress import ProgressTracker
    from cbgen.io.stop import StopFlag

    engine = Engine(
        model=str(tiny_model_dir("llama")),
        device="cpu",
        kv_cache_memory=4 << 20,
        max_num_seqs=4,
        num_threads=1,
    )
    consumed = [0]
    first_write_at: list[int] = []
    peak = [0]

    def rows() -> Any:
        for i in range(60):
            consumed[0] += 1
            yield InputRow(
                i, f"line {i + 1}", f"r{i}", prompt=[3 + i % 50, 4, 5], overrides={"max_tokens": 3}
            )

    layout = _layout(tmp_path)
    writer = StagingWriter(layout.staging, SCHEMA, "t")
    real_step = engine.step

    def step() -> Any:
        peak[0] = max(peak[0], engine.num_unfinished_requests)
        out = real_step()
        if out.finished and not first_write_at:
            first_write_at.append(consumed[0])
        return out

    engine.step = step  # type: ignore[method-assign]
    loop = GenerationLoop(
        engine,
        rows(),
        writer,
        ProgressTracker(4),
        Display(),
        SamplingParams(temperature=0.0),
        KeySet(),
        StopFlag(),
    )
    assert loop.run()
    writer.close()
    assert loop.queue_depth == 8
    assert peak[0] == 8
    assert first_write_at[0] == 8  # the first results came back after reading only 8 rows
    assert sum(b.num_rows for b in read_stream(writer.path)) == 60


def test_loop_skips_done_rows_and_expands_samples(
    tmp_path: Path, tiny_model_dir: Callable[[str], Path]
) -> None:
    from cbgen.display import Display
    from cbgen.engine.engine import Engine
    from cbgen.io.pipeline import GenerationLoop
    from cbgen.io.progress import ProgressTracker
    from cbgen.io.stop import StopFlag

    engine = Engine(
        model=str(tiny_model_dir("llama")),
        device="cpu",
        kv_cache_memory=4 << 20,
        max_num_seqs=4,
        num_threads=1,
    )
    rows = [
        InputRow(0, "line 1", "a", prompt=[5, 6, 7], overrides={"n": 3}),
        InputRow(1, "line 2", "b", prompt=[5, 6, 7]),
        InputRow(2, "line 3", "c", prompt=[5, 6, 7], overrides={"max_tokens": 5000}),
        InputRow(3, "line 4", "d", error="line 4: broken"),
    ]
    done = KeySet(np.array([row_key("a", 1), row_key("b", 0), row_key("d", 0)], dtype="S16"))
    layout = _layout(tmp_path)
    writer = StagingWriter(layout.staging, SCHEMA, "t")
    tracker = ProgressTracker(4)
    loop = GenerationLoop(
        engine,
        iter(rows),
        writer,
        tracker,
        Display(),
        SamplingParams(temperature=0.0, max_tokens=2),
        done,
        StopFlag(),
    )
    assert loop.run()
    writer.close()
    got = sorted(
        (r["id"], r["sample_index"], r["finish_reason"])
        for b in read_stream(writer.path)
        for r in b.to_pylist()
    )
    assert got == [("a", 0, "length"), ("a", 2, "length"), ("c", 0, "error")]
    assert (tracker.rows_done, tracker.rows_resumed, tracker.rows_failed) == (4, 2, 1)
    err = next(r for b in read_stream(writer.path) for r in b.to_pylist() if r["id"] == "c")
    assert err["error"].startswith(
        "line 3: max_tokens: prompt (3 tokens) + max_tokens (5000) exceeds max_model_len"
    )
    assert err["prompt_tokens"] == 3


def test_params_cache_tells_types_apart(tmp_path: Path) -> None:
    from cbgen.display import Display
    from cbgen.io.pipeline import GenerationLoop
    from cbgen.io.progress import ProgressTracker
    from cbgen.io.stop import StopFlag

    class NoEngine:
        class config:  # stands in for EngineConfig
            max_num_seqs = 4

        def reasoning_tags(self) -> None:
            return None

    layout = _layout(tmp_path)
    loop = GenerationLoop(
        NoEngine(),
        iter([]),
        StagingWriter(layout.staging, SCHEMA, "t"),
        ProgressTracker(4),  # type: ignore[arg-type]
        Display(),
        SamplingParams(),
        KeySet(),
        StopFlag(),
    )
    assert loop._params({"max_tokens": True}) == "max_tokens: must be an integer, got True"
    p = loop._params({"max_tokens": 1})
    assert isinstance(p, SamplingParams) and p.max_tokens == 1
    assert loop._params({"max_tokens": 1}) is p
    s = loop._params({"stop": ["a", "b"]})
    assert (
        isinstance(s, SamplingParams)
        and s.stop == ["a", "b"]
        and loop._params({"stop": ["a", "b"]}) is s
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "t.arrows").symlink_to("/dev/full")  # every write fails with ENOSPC
    with pytest.raises(
        OutputError, match=r"^no space left on the device while writing .*t\.arrows$"
    ):
        w = StagingWriter(tmp_path, SCHEMA, "t")
        w.add(_rec(0))
        w.flush()


def test_live_view_renders_every_figure() -> None:
    import io

    from rich.console import Console

    from cbgen.display import LiveDisplay

    console = Console(file=io.StringIO(), width=80)
    console.print(LiveDisplay._render(_snap()))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    for part in (
        "rows 1200/10000 12.0%",
        "45.2 rows/s",
        "ETA 3m15s",
        "slots 60/64",
        "waiting 128",
        "KV cache 71.3%",
        "preemptions 4",
        "prefill 1520 tok/s",
        "decode 900 tok/s",
        "cache hit 12.5%",
    ):
        assert part in text, part
    out = io.StringIO()
    live = LiveDisplay(out)
    live.start()
    live.update(_snap())
    live.message("a message")
    live.stop(_snap(rows_done=10000))
    assert "a message" in out.getvalue() and "rows 10000/10000 100.0%" in out.getvalue()
