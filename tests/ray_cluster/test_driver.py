"""`cbgen run --ray ADDRESS` on a real local Ray cluster of 2 CPUs (the session's ray_cluster,
which each run joins as a driver of its own): the output of two engines equals a local run's row
for row, bad rows included; an engine killed mid-run loses and duplicates nothing; a driver
stopped (SIGTERM) or killed mid-run is resumed by the same command."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

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

pytestmark = [pytest.mark.xdist_group("ray")]  # one worker, one cluster

READY = re.compile(r"^engine (\d+) \(pid (\d+) on \S+\) ready")
SAME = ("id", "row", "sample_index", "prompt_tokens", "completion", "completion_tokens")
SAME += ("finish_reason", "stop_reason", "error", "request_kind")


def _ray(address: str, slots: int = 2) -> list[str]:
    """Two engines of one CPU each, a few slots each."""
    return ["--ray", address, "--cpus-per-engine", "1", "--max-num-seqs", str(slots)]


def test_two_engines_give_the_local_run_s_rows(
    tmp_path: Path, chat_model: Path, ray_cluster: str
) -> None:
    rows: list[object] = [
        {"id": f"r{i}", "prompt": f"Row {i} asks for a story.", "max_tokens": 3 + i % 4}
        for i in range(10)
    ]
    rows[3] = "{not json"
    rows[6] = {"id": "long", "prompt": "x " * 3000}  # longer than the model allows
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "Hi!"}], "n": 2})
    rows.append({"id": "sampled", "prompt": "Once", "temperature": 1.0, "n": 2})
    rows.append({"id": "bad", "prompt": "x", "top_p": 7})
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    local = run(["run", str(src), "-o", str(tmp_path / "local.parquet"), *tiny(chat_model)])
    assert local.returncode == 0, local.stderr
    out = tmp_path / "ray.parquet"
    r = run(["run", str(src), "-o", str(out), *tiny(chat_model), *_ray(ray_cluster, slots=8)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Ray: 2 engines of 1 CPU each" in r.stdout
    # every row made once, by one engine or the other (how they split depends on when each
    # finished loading: tests/ray_cluster/test_share.py checks the rule)
    made = re.search(r"^rows made by each engine: (\d+), (\d+)$", r.stdout, re.M)
    assert made is not None, r.stdout
    assert sum(map(int, made.groups())) == 13
    got, want = read_rows(out), read_rows(tmp_path / "local.parquet")
    assert [{k: g[k] for k in SAME} for g in got] == [{k: w[k] for k in SAME} for w in want]
    assert [g["error"] is not None for g in got].count(True) == 3  # the three bad rows
    summary = json.loads((tmp_path / "ray.summary.json").read_text())
    assert summary["rows"] == {"output": 15, "ok": 12, "failed": 3, "input_rows": 13}
    assert summary["ray"]["address"] == ray_cluster and summary["ray"]["cpus_per_engine"] == 1
    assert summary["this_run"]["rows_generated"] == 13
    assert set(summary["this_run"]["startup_s"]) == {"total", "build", "tune", "load", "other"}


N = 60
"""Rows of the kill tests: 96 tokens each over two engines of two slots, seconds of work (at 48
a busy CI machine once finished them on one engine before the second had loaded)."""


def _long_run(tmp_path: Path, chat_model: Path, ray_cluster: str) -> list[str]:
    src = many_rows(tmp_path / "in.jsonl", N, max_tokens=96)
    out = ["-o", str(tmp_path / "out.parquet"), "--log-interval", "0.05"]
    return ["run", str(src), *out, *tiny(chat_model), *_ray(ray_cluster)]


def test_an_engine_killed_mid_run_loses_and_duplicates_nothing(
    tmp_path: Path, chat_model: Path, ray_cluster: str
) -> None:
    running = Running(_long_run(tmp_path, chat_model, ray_cluster))
    both = re.compile(r"slots \d+/4 waiting \d+ .*\| engines 2$", re.M)  # figures summed
    running.wait_for(lambda: len(_ready(running)) == 2 and bool(both.search(running.output())))
    victim = _ready(running)[1]
    os.kill(victim, signal.SIGKILL)
    assert running.finish() == 0, running.output()
    assert re.search(r"engine 1 \(pid \d+ on \S+\) was lost .* Ray restarts it", running.output())
    assert_complete(tmp_path / "out.parquet", N)  # every id once, none lost
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["this_run"]["rows_generated"] == N


def test_a_stopped_or_killed_driver_is_resumed_by_the_same_command(
    tmp_path: Path, chat_model: Path, ray_cluster: str
) -> None:
    """SIGTERM flushes the rows finished and exits 143 (ray.init's own handler would exit at
    once); kill -9 keeps what was flushed and Ray drops the engines; each time the same command
    resumes, and the output holds every row once."""
    args = _long_run(tmp_path, chat_model, ray_cluster)
    staging = tmp_path / "out.partial"
    first = Running(args)
    first.wait_for(lambda: staged_rows(staging) >= 10)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 128 + signal.SIGTERM, first.output()
    assert re.search(r"interrupted \(SIGTERM\): \d+ rows of this run are saved", first.output())
    saved = staged_rows(staging)
    second = Running(args)
    second.wait_for(lambda: staged_rows(staging) >= saved + 10)
    second.proc.kill()  # kill -9: no flush, no goodbye
    second.finish()
    assert "resuming" in second.output()
    kept = staged_rows(staging)
    third = run(args, timeout=300)
    assert third.returncode == 0, third.stdout + third.stderr
    assert_complete(tmp_path / "out.parquet", N)
    generated = json.loads((tmp_path / "out.summary.json").read_text())["this_run"]
    assert 0 < generated["rows_generated"] <= N - kept and generated["rows_resumed"] >= kept


def _ready(running: Running) -> list[int]:
    """The pids of the engines that said they were ready, by engine index."""
    found = {int(m[1]): int(m[2]) for line in list(running.lines) if (m := READY.match(line))}
    return [found[k] for k in sorted(found)]
