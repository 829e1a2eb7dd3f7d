"""`cbgen run` end to end: the real CLI in a subprocess, output read back with pyarrow.

The model is a tiny dummy-weight Llama (hidden 64, 2 layers) with SmolLM2's tokenizer and
chat template and SmolLM2's vocabulary size, so real text and chat prompts tokenize to valid
ids; it is written once per test session (shared by xdist workers)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO
from helpers.cli import (
    STATUS,
    Running,
    assert_complete,
    check_latencies,
    cli,
    cli_env,
    many_rows,
    read_rows,
    run,
    staged_rows,
    tiny,
    write_jsonl,
)

from cbgen.io.schema import LATENCY_COLUMNS, LOGPROB_COLUMNS

SAMPLE = REPO / "sample_data"

BASE_COLUMNS = [
    "id",
    "row",
    "sample_index",
    "prompt_tokens",
    "cached_tokens",
    "completion",
    "reasoning",
    "completion_tokens",
    "finish_reason",
    "stop_reason",
    "error",
    "request_kind",
    *LATENCY_COLUMNS,
    "num_preemptions",
    *LOGPROB_COLUMNS,
]


# ---- options and errors ----------------------------------------------------------------------


def test_run_help_shows_defaults_and_sizes() -> None:
    """Every field is an option (tests/test_cli_options.py); here, what --help prints."""
    out = run(["run", "--help"], timeout=60)
    assert out.returncode == 0
    for text in (
        "--max-num-seqs",
        "[default: 64]",
        "--kv-cache-memory",
        "4GiB",
        "--num-threads",
        "--enable-prefix-caching",
        "--top-p",
        "--log-interval",
        "[default: 10.0]",
    ):
        assert text in out.stdout, text


@pytest.mark.parametrize("command", ["run", "bench"])
def test_help_spells_out_every_option_in_a_narrow_terminal(command: str) -> None:
    """Rich's option panels cut long names short under ~120 columns ("--max-num-batche…"), and a
    pipe counts as 80: there --help is plain text, every option written in full."""
    import typer

    from cbgen.bench.command import bench
    from cbgen.run_command import run as run_fn

    app = typer.Typer(add_completion=False)  # as cbgen.cli builds it
    app.command()({"run": run_fn, "bench": bench}[command])
    params = typer.main.get_command(app).params
    names = [o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
    assert "--max-num-batched-tokens" in names and "--no-enable-prefix-caching" in names
    for columns, panels in (("80", False), ("200", True)):
        out = run([command, "--help"], timeout=60, env=cli_env(COLUMNS=columns))
        assert out.returncode == 0, out.stderr
        assert "…" not in out.stdout, columns
        missing = [n for n in names if n not in out.stdout]
        assert not missing, (columns, missing)
        assert ("╭─ " in out.stdout) is panels, columns  # Rich's panels, or plain text
        if not panels:
            assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_clear_errors_without_tracebacks(tmp_path: Path, chat_model: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "hi"}])
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "noprompt.parquet")
    (tmp_path / "afile").write_text("")
    cases = [
        (
            ["run", str(tmp_path / "missing.jsonl"), *tiny(chat_model)],
            1,
            f"input file {tmp_path / 'missing.jsonl'} does not exist",
        ),
        (["run", str(tmp_path / "bad.parquet"), *tiny(chat_model)], 1, "as Parquet"),
        (
            ["run", str(tmp_path / "noprompt.parquet"), *tiny(chat_model)],
            1,
            "neither a 'prompt' nor a 'messages' column",
        ),
        (
            ["run", str(good), "-o", str(tmp_path / "afile" / "o.parquet"), *tiny(chat_model)],
            1,
            "output folder",
        ),
        (
            ["run", str(good), "--model", str(tmp_path / "nomodel"), "--load-format", "dummy"],
            1,
            "not found",
        ),
        (["run", "-", *tiny(chat_model)], 1, "reading stdin: give the output file with -o"),
        (["run", str(good), "--kv-cache-memory", "lots"], 2, "kv_cache_memory: expected a size"),
        (["run", str(good), "--max-num-seqs", "0"], 2, "max_num_seqs: must be >= 1, got 0"),
        (["run", str(good), "--shard", "3/2"], 2, "shard: need 0 <= I < N"),
    ]
    procs = [
        subprocess.Popen(
            cli(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
            stdin=subprocess.DEVNULL,
        )
        for args, _, _ in cases
    ]
    for (args, code, message), p in zip(cases, procs, strict=True):
        out, err = p.communicate(timeout=120)
        assert p.returncode == code, (args, out, err)
        assert err.startswith("error: ") and message in err, (args, err)
        assert "Traceback" not in err + out, (args, err)
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.out.parquet"))


# ---- inputs ----------------------------------------------------------------------------------


def test_jsonl_chat_openai_rows_samples_and_prefix_cache(tmp_path: Path, chat_model: Path) -> None:
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 8  # several full KV blocks
    src = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "text", "prompt": long_prompt},
            {"id": "again", "prompt": long_prompt},  # same prompt: served from the prefix cache
            {"id": 42, "prompt": [5, 6, 7, 8, 9], "max_tokens": 3},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello!"},
                ]
            },
            {
                "custom_id": "oa-chat",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 2,
                },
            },
            {
                "custom_id": "oa-comp",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "x", "prompt": "Once"},
            },
            {
                "id": "n3",
                "prompt": "Pick a number:",
                "n": 3,
                "temperature": 1.0,
                "seed": 10,
                "max_tokens": 6,
            },
            {
                "id": "seed12",
                "prompt": "Pick a number:",
                "temperature": 1.0,
                "seed": 12,
                "max_tokens": 6,
            },
        ],
    )
    out = run(["run", str(src), *tiny(chat_model, "--max-num-seqs", "1", "--log-interval", "60")])
    assert out.returncode == 0, out.stderr + out.stdout
    result = tmp_path / "mixed.out.parquet"  # the default output, beside the input
    assert pq.read_schema(result).names == BASE_COLUMNS
    rows = read_rows(result)
    check_latencies(rows)
    assert [(r["id"], r["row"], r["sample_index"]) for r in rows] == [
        ("text", 0, 0),
        ("again", 1, 0),
        ("42", 2, 0),
        ("3", 3, 0),
        ("oa-chat", 4, 0),
        ("oa-comp", 5, 0),
        ("n3", 6, 0),
        ("n3", 6, 1),
        ("n3", 6, 2),
        ("seed12", 7, 0),
    ]
    assert all(r["finish_reason"] == "length" for r in rows), rows
    by = {(r["id"], r["sample_index"]): r for r in rows}
    assert by[("42", 0)]["prompt_tokens"] == 5 and by[("42", 0)]["completion_tokens"] == 3
    assert by[("oa-chat", 0)]["completion_tokens"] == 2
    assert by[("text", 0)]["cached_tokens"] == 0 and by[("again", 0)]["cached_tokens"] >= 64
    # sample i of a row with seed s draws with seed s + i: sample 2 of n3 is row seed12's draw
    assert by[("n3", 2)]["completion"] == by[("seed12", 0)]["completion"]
    assert len({by[("n3", i)]["completion"] for i in range(3)}) == 3
    summary = json.loads((tmp_path / "mixed.out.summary.json").read_text())
    ok = [r for r in rows if r["finish_reason"] != "error"]
    assert summary["rows"] == {"output": 10, "ok": 10, "failed": 0, "input_rows": 8}
    assert summary["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in ok)
    assert summary["tokens"]["cache_hit_rate"] == pytest.approx(
        sum(r["cached_tokens"] for r in ok) / sum(r["prompt_tokens"] for r in ok)
    )
    assert summary["engine"]["max_num_seqs"] == 1 and summary["cbgen_version"]
    assert summary["latency_s"]["e2e_s"]["p50"] > 0
    assert "rows: 10 written (10 ok, 0 failed" in out.stdout
    assert not (tmp_path / "mixed.out.partial").exists()


def test_parquet_with_chat_column_and_pass_through(tmp_path: Path, chat_model: Path) -> None:
    """The sample Parquet (prompt and messages columns, per-row max_tokens, temperature, n,
    seed, stop ...) with --keep-columns; --quiet prints the summary and no status lines."""
    out_path = tmp_path / "sample.out.parquet"
    out = run(
        [
            "run",
            str(SAMPLE / "prompts.parquet"),
            "-o",
            str(out_path),
            "--keep-columns",
            "topic",
            "--quiet",
            "--log-interval",
            "0.01",
            *tiny(chat_model),
        ]
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert not any(STATUS.match(line) for line in out.stdout.splitlines())
    src = pq.read_table(SAMPLE / "prompts.parquet").to_pylist()
    expected = [(s["id"], i, s["topic"]) for s in src for i in range(s["n"] or 1)]
    assert f"rows: {len(expected)} written ({len(expected)} ok" in out.stdout
    rows = read_rows(out_path)
    check_latencies(rows)
    assert [(r["id"], r["sample_index"], r["topic"]) for r in rows] == expected
    by_id = {s["id"]: s for s in src}
    for r in rows:
        s = by_id[r["id"]]
        if s["stop"]:  # random weights may or may not produce the stop string
            assert (
                r["finish_reason"] in ("stop", "length")
                and r["completion_tokens"] <= s["max_tokens"]
            )
        else:  # and they never produce EOS
            assert (r["finish_reason"], r["completion_tokens"]) == ("length", s["max_tokens"] or 4)


def test_parquet_columns_and_types_pass_through(tmp_path: Path, chat_model: Path) -> None:
    meta_type = pa.struct([("source", pa.string()), ("tags", pa.list_(pa.string()))])
    table = pa.table(
        {
            "key": pa.array([10, 11, 12], pa.int64()),
            "text": ["first prompt", "second prompt", None],
            "meta": pa.array(
                [{"source": "a", "tags": ["x"]}, {"source": "b", "tags": []}, None], meta_type
            ),
            "when": pa.array([1_700_000_000_000_000, 1_700_000_100_000_000, 0], pa.timestamp("us")),
            "max_tokens": pa.array([2, None, 3], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    out = run(
        [
            "run",
            str(tmp_path / "in.parquet"),
            "--prompt-column",
            "text",
            "--id-column",
            "key",
            "--keep-columns",
            "meta,when",
            *tiny(chat_model),
        ]
    )
    assert out.returncode == 0, out.stderr + out.stdout
    result = pq.read_table(tmp_path / "in.out.parquet")
    assert result.schema.field("meta").type == meta_type and result.schema.field(
        "when"
    ).type == pa.timestamp("us")
    rows = read_rows(tmp_path / "in.out.parquet")
    assert [(r["id"], r["completion_tokens"], r["finish_reason"]) for r in rows] == [
        ("10", 2, "length"),
        ("11", 4, "length"),
        ("12", 0, "error"),
    ]
    assert rows[2]["error"] == "row 2: no prompt: the 'text' field is missing or null"
    assert [r["meta"] for r in rows] == table.column("meta").to_pylist()
    assert [r["when"] for r in rows] == table.column("when").to_pylist()


def test_bad_rows_become_error_rows_and_the_error_rate_sets_the_exit_code(
    tmp_path: Path, chat_model: Path
) -> None:
    src = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "ok1", "prompt": "fine"},
            "{broken json",
            {"id": "noprompt", "text": "x"},
            {"id": "wrongtype", "prompt": {"a": 1}},
            {"id": "role", "messages": [{"role": "wizard", "content": "x"}]},
            {"id": "long", "prompt": "word " * 80},
            {"id": "topp", "prompt": "x", "top_p": 1.5},
            {"id": "vocab", "prompt": [1, 2, 999999]},
            {"id": "ok2", "messages": [{"role": "user", "content": "fine too"}]},
        ],
    )
    args = ["run", str(src), *tiny(chat_model, "--max-model-len", "48")]
    out = run([*args, "--max-error-rate", "0.5"])
    assert out.returncode == 3, out.stderr + out.stdout
    assert "error rate 77.8% is above --max-error-rate 50.0%" in out.stdout
    rows = read_rows(tmp_path / "mixed.out.parquet")
    check_latencies(rows)
    errors = {r["id"]: r["error"] for r in rows}
    assert errors["ok1"] is None and errors["ok2"] is None
    assert (
        errors["1"]
        == "line 2: invalid JSON: Expecting property name enclosed in double quotes (column 2)"
    )
    assert (
        errors["noprompt"]
        == "line 3: no prompt: give a 'prompt' (text or token ids) or 'messages' (chat) field"
    )
    assert (
        errors["wrongtype"]
        == 'line 4: prompt: must be a string or a list of token ids, got {"a": 1}'
    )
    assert (
        errors["role"]
        == "line 5: messages[0].role: unknown role 'wizard' (expected system, user, assistant, tool)"
    )
    assert errors["long"].startswith("line 6: prompt: ") and "max_model_len" in errors["long"]
    assert errors["topp"] == "line 7: top_p: must be in (0, 1], got 1.5"
    assert errors["vocab"] == "line 8: prompt: token id 999999 is outside the vocabulary [0, 49152)"
    assert [r["row"] for r in rows] == list(range(9))
    summary = json.loads((tmp_path / "mixed.out.summary.json").read_text())
    assert summary["rows"] == {"output": 9, "ok": 2, "failed": 7, "input_rows": 9}
    # Rerun: nothing left to do (error rows are results too), default --max-error-rate 1.0 -> 0.
    again = run(args)
    assert again.returncode == 0, again.stderr + again.stdout
    assert "this run generated 0 rows, resumed 9" in again.stdout
    assert read_rows(tmp_path / "mixed.out.parquet") == rows


def test_stdin_rows_reach_the_engine_before_the_input_ends(
    tmp_path: Path, chat_model: Path
) -> None:
    out_path = tmp_path / "stdin.out.parquet"
    r = Running(
        ["run", "-", "-o", str(out_path), *tiny(chat_model, "--log-interval", "0.05")],
        stdin=subprocess.PIPE,
    )
    assert r.proc.stdin is not None
    for i in range(3):
        r.proc.stdin.write(json.dumps({"id": f"s{i}", "prompt": f"row {i}"}) + "\n")
    r.proc.stdin.flush()
    staging = tmp_path / "stdin.out.partial"
    # The first rows are generated and on disk while stdin is still open.
    r.wait_for(lambda: staging.is_dir() and staged_rows(staging) == 3)
    for i in range(3, 5):
        r.proc.stdin.write(json.dumps({"id": f"s{i}", "prompt": f"row {i}"}) + "\n")
    r.proc.stdin.close()
    assert r.finish() == 0, r.output()
    assert [x["id"] for x in read_rows(out_path)] == [f"s{i}" for i in range(5)]


# ---- interruptions ---------------------------------------------------------------------------


def test_kill_9_mid_run_then_rerun_resumes(tmp_path: Path, chat_model: Path) -> None:
    src = many_rows(tmp_path / "k.jsonl", 120)
    args = ["run", str(src), *tiny(chat_model, "--max-num-seqs", "4", "--log-interval", "0.05")]
    r = Running(args)
    r.wait_for(lambda: r.rows_done() >= 15)
    time.sleep(0.3)  # > the 0.1 s flush interval
    r.proc.kill()
    assert r.finish() == -signal.SIGKILL
    assert not (tmp_path / "k.out.parquet").exists()
    saved = staged_rows(tmp_path / "k.out.partial")
    assert 15 <= saved < 120
    again = run(args)
    assert again.returncode == 0, again.stderr + again.stdout
    assert f"this run generated {120 - saved} rows, resumed {saved}" in again.stdout
    assert_complete(tmp_path / "k.out.parquet", 120)
    assert not (tmp_path / "k.out.partial").exists()


def test_sigterm_flushes_and_says_how_to_resume_and_status_lines(
    tmp_path: Path, chat_model: Path
) -> None:
    src = many_rows(tmp_path / "t.jsonl", 240)
    args = ["run", str(src), *tiny(chat_model, "--max-num-seqs", "4", "--log-interval", "0.1")]
    r = Running(args)

    # mid-run, with a few status lines out (the tiny model can reach 20 rows within 0.2 s), the
    # last of them after the background count of the input's rows
    def ready() -> bool:
        lines = [m for m in (STATUS.match(line) for line in list(r.lines)) if m]
        return r.rows_done() >= 20 and len(lines) >= 3 and lines[-1].group(3) is not None

    r.wait_for(ready)
    r.proc.send_signal(signal.SIGTERM)
    assert r.finish() == 128 + signal.SIGTERM, r.output()
    m = re.search(
        r"interrupted \(SIGTERM\): (\d+) rows of this run are saved in (\S+); rerun the same command to resume",
        r.output(),
    )
    assert m, r.output()
    assert int(m.group(1)) == staged_rows(tmp_path / "t.out.partial") >= 20
    # Not a terminal: one plain status line every --log-interval seconds.
    status = [STATUS.match(line) for line in r.lines if STATUS.match(line)]
    assert len(status) >= 3
    # the total: counted by a background thread, so the first lines may come before it; from
    # the first line that shows it on, every line shows the exact 240
    totals = [s.group(3) for s in status]
    first = next(i for i, t in enumerate(totals) if t is not None)
    assert totals[first:] == ["240"] * (len(totals) - first) and set(totals[:first]) <= {None}
    done = [int(s.group(2)) for s in status]
    assert done == sorted(done)
    last = next(line for line in reversed(r.lines) if STATUS.match(line))
    for field in (
        " rows/s ETA ",
        " | slots ",
        "/4 waiting ",
        " | kv ",
        "% | preemptions ",
        " | prefill ",
        " tok/s decode ",
        " | cache hit ",
    ):
        assert field in last, (field, last)
    again = run(args)
    assert again.returncode == 0, again.stderr + again.stdout
    assert_complete(tmp_path / "t.out.parquet", 240)


# ---- scale out -------------------------------------------------------------------------------


def test_shards_cover_every_row_once_with_slurm_pickup(tmp_path: Path, chat_model: Path) -> None:
    src = many_rows(tmp_path / "s.jsonl", 31, max_tokens=2)
    out_dir = tmp_path / "parts.parquet"
    base = ["run", str(src), "-o", str(out_dir), *tiny(chat_model, "--quiet")]
    procs = [
        subprocess.Popen(
            cli(*base, "--shard", "0/3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        ),
        subprocess.Popen(
            cli(*base),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(
                SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_TASK_MIN="0"
            ),
        ),
        subprocess.Popen(
            cli(*base, "--shard", "2/3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=cli_env(),
        ),
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert "shard 1/3 from SLURM_ARRAY_TASK_ID=1, SLURM_ARRAY_TASK_COUNT=3" in outs[1]
    for i in range(3):
        part = pq.read_table(out_dir / f"part-{i:05d}-of-00003.parquet")
        assert all(row % 3 == i for row in part.column("row").to_pylist())
        assert (out_dir / f"_part-{i:05d}-of-00003.summary.json").exists()
    assert_complete(out_dir, 31)  # the folder reads as one dataset


def test_data_parallel_on_cpu_reports_a_killed_worker_and_resumes(
    tmp_path: Path, chat_model: Path
) -> None:
    src = many_rows(tmp_path / "dp.jsonl", 80)
    args = [
        "run",
        str(src),
        "--data-parallel-size",
        "2",
        *tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05"),
    ]
    r = Running(args)
    r.wait_for(lambda: r.rows_done() >= 6)
    pids = re.search(r"data parallel: 2 workers \(pids (\d+), (\d+)\)", r.output())
    assert pids, r.output()
    victim = int(pids.group(2))
    assert psutil.Process(victim).ppid() == r.proc.pid
    os.kill(victim, signal.SIGKILL)
    assert r.finish() == 1, r.output()
    assert f"worker 1 (pid {victim}) was killed by SIGKILL" in r.output()
    assert (
        "1 of 2 workers failed" in r.output() and "Rerun the same command to resume" in r.output()
    )
    assert not (tmp_path / "dp.out.parquet").exists()
    saved = staged_rows(tmp_path / "dp.out.partial")
    assert saved >= 6
    again = run(args, timeout=300)
    assert again.returncode == 0, again.stderr + again.stdout
    assert f"resumed {saved}" in again.stdout
    assert_complete(tmp_path / "dp.out.parquet", 80)
    summary = json.loads((tmp_path / "dp.out.summary.json").read_text())
    assert summary["data_parallel_size"] == 2 and summary["this_run"]["rows_resumed"] == saved


def _memory_run(tmp_path: Path, model: Path, n: int) -> tuple[float, float, float, float]:
    """Run n rows (every 50th a real request of 5 token ids and max_tokens 1, the others
    failing fast on max_tokens=0 after being parsed); returns (input MiB, RSS MiB when a quarter
    of the rows were done (allocators settled), RSS MiB just before the last row was done, peak
    RSS MiB of the whole run)."""
    src = tmp_path / f"rows{n}.jsonl"
    filler = "lorem ipsum " * 50
    with open(src, "w") as f:
        for i in range(n):
            if i % 50 == 0:
                f.write(
                    json.dumps({"id": i, "prompt": [10 + i % 400, 11, 12, 13, 14], "max_tokens": 1})
                    + "\n"
                )
            else:
                f.write(json.dumps({"id": i, "prompt": filler, "max_tokens": 0}) + "\n")
    r = Running(["run", str(src), *tiny(model, "--log-interval", "0.05")])
    proc = psutil.Process(r.proc.pid)
    early = late = peak = 0
    while r.proc.poll() is None:
        try:
            rss = proc.memory_info().rss
        except psutil.NoSuchProcess:
            break
        done = r.rows_done()
        if not early and done >= n // 4:
            early = rss
        if done < n:
            late = rss
        peak = max(peak, rss)
        time.sleep(0.02)
    assert r.finish() == 0, r.output()[-3000:]
    assert pq.ParquetFile(tmp_path / f"rows{n}.out.parquet").metadata.num_rows == n
    summary = json.loads((tmp_path / f"rows{n}.out.summary.json").read_text())
    assert summary["rows"] == {"output": n, "ok": n // 50, "failed": n - n // 50, "input_rows": n}
    mib = 2**20
    return src.stat().st_size / mib, early / mib, late / mib, peak / mib


def test_streaming_memory_does_not_grow_with_the_input(tmp_path: Path, chat_model: Path) -> None:
    """20,000 rows, then 200,000 rows (about 120 MB of JSONL): the resident set does not grow
    while the last 150,000 rows stream through, and the whole run's peak (loading, generation
    and the final Parquet copy) grows by far less than the input did: holding the extra 180,000
    rows in memory in any form would add more than the 109 MiB of input text."""
    small = _memory_run(tmp_path, chat_model, 20_000)
    size, early, late, peak = _memory_run(tmp_path, chat_model, 200_000)
    print(
        f"20k rows: input {small[0]:.0f} MiB, peak RSS {small[3]:.0f} MiB; 200k rows: input {size:.0f} MiB, "
        f"RSS at 50k rows {early:.0f} MiB, before the end {late:.0f} MiB, peak {peak:.0f} MiB"
    )
    assert size - small[0] > 100
    assert late - early < 16
    assert peak - small[3] < 0.4 * (size - small[0])


# ---- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_make_run_with_the_default_model(tmp_path: Path) -> None:
    """What `make run` does (cbgen run sample_data/prompts.jsonl, default model and options),
    writing into a temporary folder."""
    out_path = tmp_path / "prompts.out.parquet"
    out = run(
        ["run", str(SAMPLE / "prompts.jsonl"), "-o", str(out_path), "--num-threads", "1"],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    rows = read_rows(out_path)
    check_latencies(rows)
    assert len(rows) == 14 and all(r["finish_reason"] in ("stop", "length") for r in rows)
    by = {(r["id"], r["sample_index"]): r for r in rows}
    assert by[("capital-fr", 0)]["completion"].startswith(" Paris")
    assert by[("tokens", 0)]["completion"].startswith(" Paris")  # the same prompt as token ids
    assert by[("fib", 0)]["finish_reason"] == "stop"  # stop string "\n\n"
    assert {i for (rid, i) in by if rid == "names"} == {0, 1, 2}
    summary = json.loads((tmp_path / "prompts.out.summary.json").read_text())
    assert summary["model"] == "smollm2-135m-instruct" and summary["rows"]["failed"] == 0
