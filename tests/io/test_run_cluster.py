"""`cbgen run` on a shared cluster: one run per output (an OS lock), a resume that checks the
settings its rows depend on, exit codes a scheduler can act on, rows that ask for what cbgen
does not implement, and a disk that fills up mid-run. Real subprocesses where the behaviour is
the process's (locks, exit codes), the run in-process where a fault is injected."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.cli import (
    Running,
    assert_complete,
    many_rows,
    read_rows,
    run,
    staged_rows,
    tiny,
    write_jsonl,
)

from cbgen.config import EngineConfig
from cbgen.display import Display
from cbgen.io import identity
from cbgen.io.lock import OutputLock, OutputLockedError
from cbgen.io.parse import parse_mapping
from cbgen.io.part import RunPlan
from cbgen.io.rows import ColumnSpec
from cbgen.io.schema import output_schema
from cbgen.io.session import execute
from cbgen.io.stop import StopFlag
from cbgen.io.writer import OutputError, OutputLayout
from cbgen.sampling_params import SamplingParams

# ---- the output lock ---------------------------------------------------------------------------


def test_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from cbgen.io.lock import OutputLock; "
            "OutputLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputLockedError) as e:
            OutputLock(tmp_path).acquire()
        assert f"pid {holder.pid} on {socket.gethostname()}, started 20" in str(e.value)
    finally:
        holder.kill()  # kill -9: the kernel drops the lock
        holder.wait()
    lock = OutputLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_on_a_removed_folder_is_not_taken(tmp_path: Path) -> None:
    """A run that finishes removes its staging folder while it holds the lock: a file opened
    before that must not count as the lock once the folder exists anew."""
    staging = tmp_path / "o.partial"
    staging.mkdir()
    first = OutputLock(staging)
    first.acquire()
    stale_fd = os.open(staging / ".lock", os.O_RDWR)  # opened by a run that is about to lock
    os.unlink(staging / ".lock")
    first.release()
    newer = OutputLock(staging)
    newer.acquire()  # a third run locks the new file at the same path
    import fcntl

    fcntl.flock(stale_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file is free...
    with pytest.raises(OutputLockedError):  # ...but the lock's path is held
        OutputLock(staging).acquire()
    os.close(stale_fd)
    newer.release()


def test_a_second_run_on_the_same_output_refuses_at_once(tmp_path: Path, chat_model: Path) -> None:
    src = many_rows(tmp_path / "d.jsonl", 30)
    args = ["run", str(src), *tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05")]
    first = Running(args)
    first.wait_for(lambda: first.rows_done() >= 2)
    first.proc.send_signal(signal.SIGSTOP)  # holds its lock however fast the machine is
    try:
        second = run(args)
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert second.returncode == 4, second.stderr + second.stdout
    message = second.stderr.strip()
    assert message.startswith("error: another run is writing this output (pid ")
    assert f"pid {first.proc.pid} on {socket.gethostname()}" in message
    assert "loading" not in second.stdout and "model" not in second.stdout  # refused before it
    assert first.finish() == 0, first.output()
    rows = assert_complete(tmp_path / "d.out.parquet", 30)
    assert len({r["id"] for r in rows}) == 30


def test_shards_of_one_output_do_not_block_each_other(tmp_path: Path, chat_model: Path) -> None:
    src = many_rows(tmp_path / "s.jsonl", 24)
    out = tmp_path / "parts.parquet"
    base = [*tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05"), "-o", str(out)]
    a = Running(["run", str(src), *base, "--shard", "0/2"])
    a.wait_for(lambda: a.rows_done() >= 1)
    a.proc.send_signal(signal.SIGSTOP)  # shard 0 is mid-run, holding its lock, all the while
    try:
        b = run(["run", str(src), *base, "--shard", "1/2"])
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert b.returncode == 0, b.stderr + b.stdout
    assert a.finish() == 0, a.output()
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(24))


# ---- resume checks its settings --------------------------------------------------------------


def test_resume_with_other_settings_is_refused_and_names_them(
    tmp_path: Path, chat_model: Path
) -> None:
    src = many_rows(tmp_path / "r.jsonl", 60)
    args = ["run", str(src), *tiny(chat_model, "--max-num-seqs", "2", "--log-interval", "0.05")]
    first = Running(args)
    first.wait_for(lambda: first.rows_done() >= 5)
    time.sleep(0.3)
    first.proc.kill()
    first.finish()
    saved = staged_rows(tmp_path / "r.out.partial")
    assert saved >= 5

    changed = run([*args, "--top-p", "0.5", "--seed", "3"])
    assert changed.returncode == 5, changed.stderr + changed.stdout
    err = changed.stderr
    assert "generated with other settings" in err and "--overwrite" in err
    assert "--top-p: 1.0 -> 0.5" in err and "--seed: 0 -> 3" in err
    assert "--max-tokens" not in err
    assert staged_rows(tmp_path / "r.out.partial") == saved  # nothing touched

    # what only changes speed may change
    ok = run([*args, "--max-num-seqs", "7", "--num-threads", "2", "--no-enable-prefix-caching"])
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert f"resumed {saved}" in ok.stdout
    assert_complete(tmp_path / "r.out.parquet", 60)

    # the finished file remembers its settings too, and its input
    again = run([*args, "--max-tokens", "5"])
    assert again.returncode == 5 and "--max-tokens: 4 -> 5" in again.stderr
    with src.open("a") as f:
        f.write(json.dumps({"id": "late", "prompt": "one more"}) + "\n")
    grown = run(args)
    assert grown.returncode == 5 and "input file (its contents)" in grown.stderr
    fresh = run([*args, "--max-tokens", "5", "--overwrite"])
    assert fresh.returncode == 0, fresh.stderr
    rows = read_rows(tmp_path / "r.out.parquet")
    assert len(rows) == 61 and rows[-1]["id"] == "late" and rows[-1]["completion_tokens"] == 5


def test_settings_differences() -> None:
    base = {
        "model": "a.gguf",
        "model_files": "x",
        "dtype": "auto",
        "sampling": {"top_p": 1.0, "n": 1},
        "input": "p.jsonl",
        "input_file": "1:aa",
    }
    assert identity.differences(base, dict(base)) == []
    moved = dict(base, model="elsewhere/a.gguf")  # same files: the same model
    assert identity.differences(base, moved) == []
    other = dict(base, model="b.gguf", model_files="y", sampling={"top_p": 0.5, "n": 1})
    assert identity.differences(base, other) == [
        "model (its files): 'a.gguf' -> 'b.gguf'",
        "--top-p: 1.0 -> 0.5",
    ]
    edited = dict(base, input_file="2:bb")
    assert identity.differences(base, edited) == [
        "input file (its contents): 'p.jsonl (earlier contents)' -> 'p.jsonl (changed)'"
    ]


def test_file_digest_sees_both_ends_and_the_size(tmp_path: Path) -> None:
    p = tmp_path / "w.bin"
    data = bytearray(os.urandom(3 << 20))
    p.write_bytes(data)
    d0 = identity.file_digest(p)
    data[-1] ^= 1
    p.write_bytes(data)
    d1 = identity.file_digest(p)
    data[0] ^= 1
    p.write_bytes(data)
    d2 = identity.file_digest(p)
    p.write_bytes(data + b"x")
    assert len({d0, d1, d2, identity.file_digest(p)}) == 4


# ---- exit codes ----------------------------------------------------------------------------


def test_every_row_failed_exits_3_unless_told_otherwise(tmp_path: Path, chat_model: Path) -> None:
    src = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"id": "a"},
            "{nope",
            {"id": "c", "prompt": "x", "tools": [{"type": "function"}]},
        ],
    )
    args = ["run", str(src), *tiny(chat_model)]
    out = run(args)
    assert out.returncode == 3, out.stderr + out.stdout
    assert "every row failed" in out.stdout
    rows = read_rows(tmp_path / "bad.out.parquet")
    assert [r["finish_reason"] for r in rows] == ["error"] * 3
    assert rows[2]["error"] == "line 3: tools: cbgen does not implement this request field yet"
    assert run([*args, "--max-error-rate", "1.0"]).returncode == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run(["run", str(empty), *tiny(chat_model)]).returncode == 0


# ---- fields cbgen does not implement -------------------------------------------------------------


def _parse(obj: dict[str, Any], spec: ColumnSpec | None = None) -> str | None:
    return parse_mapping(obj, 0, "line 1", spec or ColumnSpec(), {}).error


def test_openai_bodies_with_fields_cbgen_lacks_are_error_rows() -> None:
    def batch(**body: Any) -> dict[str, Any]:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        return {"custom_id": "r", "url": "/v1/chat/completions", "body": body}

    ok = batch(model="gpt-x", user="u", metadata={"k": "v"}, store=False, stream=False)
    assert _parse(ok) is None
    assert _parse(batch(max_completion_tokens=4, temperature=0, seed=1, logprobs=False)) is None
    assert _parse(batch(response_format={"type": "text"}, tools=[], logit_bias=None)) is None
    assert _parse(batch(echo=True)) == (
        "line 1: body.echo: cbgen does not implement this request field yet"
    )
    assert _parse(batch(tools=[{"type": "function"}])) == (
        "line 1: body.tools: cbgen does not implement this request field yet"
    )
    misspelled = _parse(batch(temprature=0.5))
    assert misspelled is not None and misspelled.startswith(
        "line 1: body.temprature: unknown field"
    )
    assert "temperature" in misspelled


def test_plain_rows_keep_extra_fields_as_metadata_but_not_feature_requests() -> None:
    assert _parse({"prompt": "x", "source": "wiki", "tags": ["a"]}) is None
    assert _parse({"prompt": "x", "best_of": 2}) == (
        "line 1: best_of: cbgen does not implement this request field yet"
    )
    assert _parse({"prompt": "x", "tools": [{"type": "function"}]}) is not None
    # a column the user named is theirs, whatever it is called
    assert _parse({"prompt": "x", "tools": "hammer"}, ColumnSpec(keep_columns=("tools",))) is None


# ---- a full disk ----------------------------------------------------------------------------


class _FillingFile:
    """A writable file that takes `room` bytes, then writes what fits and fails with ENOSPC."""

    def __init__(self, path: str, room: list[int]) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 (closed by pyarrow through close())
        self.room = room
        self.closed = False

    def write(self, data: Any) -> int:
        data = bytes(data)
        if len(data) > self.room[0]:
            self.f.write(data[: self.room[0]])
            self.f.flush()
            self.room[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= len(data)
        self.f.write(data)
        self.f.flush()
        return len(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.closed = True
        self.f.close()

    def writable(self) -> bool:
        return True


def test_a_disk_that_fills_mid_run_keeps_what_was_flushed_and_resumes(
    tmp_path: Path, tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cbgen.io.writer as writer_mod

    src = write_jsonl(
        tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": [3 + i, 5, 7 + i]} for i in range(40)]
    )
    layout = OutputLayout.build(str(src), None, None)
    plan = RunPlan(
        input_path=str(src),
        columns=ColumnSpec(),
        layout=layout,
        engine_config=EngineConfig(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            dtype="float32",
            num_threads=1,
            max_num_seqs=4,
            kv_cache_memory=8 << 20,
        ),
        defaults=SamplingParams(max_tokens=3, temperature=0.0),
    )
    # One finished row per flush (one slot, a flush every loop), and room on the disk for the
    # stream's schema and about two of those record batches: the third is cut short.
    import cbgen.io.pipeline as pipeline_mod

    monkeypatch.setattr(pipeline_mod, "FLUSH_INTERVAL_S", 0.0)
    plan = dataclasses.replace(plan, engine_config=plan.engine_config.replace(max_num_seqs=1))
    sink = pa.BufferOutputStream()
    pa.ipc.new_stream(sink, output_schema({})).close()
    room = [sink.getvalue().size + 5000]
    real_osfile = pa.OSFile

    def filling(path: str, mode: str = "rb") -> Any:
        if mode == "wb" and path.endswith(".arrows"):
            return pa.PythonFile(_FillingFile(path, room), mode="w")
        return real_osfile(path, mode)

    monkeypatch.setattr(writer_mod.pa, "OSFile", filling)
    with pytest.raises(
        OutputError,
        match=r"^no space left on the device while writing .*\.arrows; rows finished before that are kept in .*, rerun the same command to resume$",
    ):
        execute(plan, Display(open(os.devnull, "w")), StopFlag())  # noqa: SIM115
    monkeypatch.setattr(writer_mod.pa, "OSFile", real_osfile)
    kept = staged_rows(layout.staging)
    assert 0 < kept < 40
    assert not layout.final.exists()

    assert execute(plan, Display(open(os.devnull, "w")), StopFlag()) == 0  # noqa: SIM115
    rows = pq.read_table(layout.final).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(40))
    summary = json.loads(layout.summary.read_text())
    assert summary["this_run"]["rows_resumed"] == kept, summary["this_run"]
