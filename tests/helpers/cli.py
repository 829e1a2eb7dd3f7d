"""`cbgen run` in a subprocess, as a user runs it: the command line, its environment, a run in the
background whose status lines are read as they come, and the output read back with pyarrow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cbgen.io.schema import LATENCY_COLUMNS
from cbgen.io.writer import read_stream

STATUS = re.compile(r"^\[cbgen (\S+)\] rows (\d+)(?:/(\d+))? ")


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="200", PYTHONWARNINGS="ignore"
    )
    env.update(extra)
    return env


def cli(*args: str) -> list[str]:
    exe = Path(sys.executable).parent / "cbgen"
    if exe.exists():
        return [str(exe), *args]
    return [sys.executable, "-c", "from cbgen.cli import main; main()", *args]


def tiny(model: Path, *more: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--temperature",
        "0",
        "--num-threads",
        "1",
        "--kv-cache-memory",
        "16MiB",
        "--max-tokens",
        "4",
        *more,
    ]


def run(
    args: Sequence[str],
    timeout: float = 180,
    env: dict[str, str] | None = None,
    input: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        input=input,
        cwd=cwd,
    )


class Running:
    """A CLI run in the background whose stdout lines are collected as they come."""

    def __init__(
        self, args: Sequence[str], env: dict[str, str] | None = None, stdin: Any = None
    ) -> None:
        self.proc = subprocess.Popen(
            cli(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env or cli_env(),
            stdin=stdin,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def rows_done(self) -> int:
        done = [int(m.group(2)) for line in list(self.lines) if (m := STATUS.match(line))]
        return max(done, default=0)

    def wait_for(self, cond: Callable[[], bool], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError("the run ended early:\n" + self.output())
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("timed out:\n" + self.output())
            time.sleep(0.02)

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    return (
        pq.read_table(path)
        .sort_by([("row", "ascending"), ("sample_index", "ascending")])
        .to_pylist()
    )


def check_latencies(rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        if r["finish_reason"] == "error":
            assert all(r[c] is None for c in LATENCY_COLUMNS), r
            continue
        assert r["error"] is None
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"], r
        if r["completion_tokens"] > 1:
            assert r["tpot_s"] >= 0 and 0 <= r["itl_p50_s"] <= r["itl_p99_s"] <= r["itl_max_s"], r


def staged_rows(staging: Path) -> int:
    return sum(b.num_rows for f in sorted(staging.glob("*.arrows")) for b in read_stream(f))


def many_rows(path: Path, n: int, max_tokens: int = 16) -> Path:
    return write_jsonl(
        path,
        [
            {"id": f"r{i}", "prompt": f"Row number {i} asks for a story.", "max_tokens": max_tokens}
            for i in range(n)
        ],
    )


def assert_complete(path: Path, n: int) -> list[dict[str, Any]]:
    rows = read_rows(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == n  # each id exactly once
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))
    assert all(r["finish_reason"] == "length" for r in rows)
    check_latencies(rows)
    return rows
