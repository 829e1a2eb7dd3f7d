"""tools.ray_bench on a few rows with the tiny chat model, on the session's local Ray cluster: it
times a plain run against one engine under --ray in a pair, and finds two engines' output equal
to the plain run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import cli_env, many_rows, tiny

pytestmark = [pytest.mark.xdist_group("ray")]  # one worker, one cluster


def test_the_benchmark_times_plain_and_ray_runs_in_pairs(
    tmp_path: Path, chat_model: Path, ray_cluster: str
) -> None:
    rows = many_rows(tmp_path / "rows.jsonl", 6, max_tokens=4)
    out = tmp_path / "figures.json"
    command = ["-m", "tools.ray_bench", "--rows", str(rows), "--pairs", "1", "--ray", ray_cluster]
    r = subprocess.run(
        [sys.executable, *command, "--out", str(out), "--", *tiny(chat_model)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    figures = json.loads(out.read_text())
    (pair,) = figures["pairs"]
    assert pair["first"] == "plain" and pair["plain"]["total_tokens_per_s"] > 0
    assert figures["median_total_tok_s_ratio"] == pair["total_tok_s_ratio"] > 0
    assert figures["two_engines"]["identical"] and figures["two_engines"]["rows"] == 6
    assert "ray (one engine) / plain, median of 1 pairs" in r.stdout
