"""`cbgen bench` end to end on a tiny dummy-weight model that has the SmolLM2 tokenizer (saved
next to its config.json), on real ShareGPT data: exact output lengths, the JSON keys, the
Parquet rows, the plot, --request-rate and --sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from cbgen.bench.command import bench
from cbgen.bench.sharegpt import sample_sharegpt
from cbgen.bench.workloads import poisson_arrivals
from tools.model_shapes import TINY_LLAMA

REQUIRED = (
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "queue_p99_s",
    "padding_waste",
    "num_preemptions",
    "wall_s",
    "ttft_mean_s",
    "tpot_p99_s",
    "itl_p99_s",
    "queue_mean_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "slot_occupancy",
    "peak_kv_usage",
    "cache_hit_rate",
    "cached_tokens",
    "computed_tokens_per_s",
    "decode_batch_mean",
    "decode_step_mean_s",
    "decode_tokens_per_s",
    "other_load",
)
COMMON = [
    "--num-threads",
    "1",
    "--kv-cache-memory",
    "16MiB",
    "--load-format",
    "dummy",
    "--num-warmup",
    "1",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json of a tiny llama (vocabulary 512: token ids are folded into it) and the
    SmolLM2 tokenizer with its chat template."""
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-with-tokenizer")
    config = {**TINY_LLAMA, "max_position_embeddings": 2048}
    (folder / "config.json").write_text(json.dumps(config))
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


def invoke(*args: str) -> Any:
    app = typer.Typer()
    app.command()(bench)
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_bench_compare_sharegpt_writes_json_parquet_and_plot(
    model_dir: Path, tmp_path: Path
) -> None:
    js, pqt, png = tmp_path / "b.json", tmp_path / "b.parquet", tmp_path / "b.png"
    result = invoke(
        "--model",
        str(model_dir),
        *COMMON,
        "--num-prompts",
        "8",
        "--max-output-len",
        "24",
        "--compare",
        "static",
        "--static-batch-size",
        "4",
        "--seed",
        "3",
        "--output-json",
        str(js),
        "--output-parquet",
        str(pqt),
        "--plot",
        str(png),
    )
    assert "continuous / static" in result.output and "padding waste" in result.output
    doc = json.loads(js.read_text())
    assert set(doc) >= {"workload", "engine", "results"}
    assert set(doc["results"]) == {"continuous", "static"}
    for res in doc["results"].values():
        assert set(REQUIRED) <= set(res)
        assert res["num_requests"] == 8 and res["num_errors"] == 0 and res["num_preemptions"] == 0
        assert res["other_load"] >= 0 and res["decode_tokens_per_s"] > 0
    assert doc["results"]["continuous"]["padding_waste"] == 0.0
    assert doc["results"]["static"]["padding_waste"] > 0.0
    assert doc["workload"]["name"] == "sharegpt" and doc["workload"]["chat_template"] is True
    assert doc["engine"]["config"]["static_batch_size"] == 4 and doc["engine"]["load_time_s"] > 0
    assert doc["ratios"]["continuous / static"]["output_tokens_per_s"] == pytest.approx(
        doc["results"]["continuous"]["output_tokens_per_s"]
        / doc["results"]["static"]["output_tokens_per_s"]
    )

    # The very requests the sampling rules give, each generating exactly its output length.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    expected = sample_sharegpt(
        lambda text: tok(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"],
        lambda text: len(tok(text, add_special_tokens=False)["input_ids"]),
        8,
        3,
        max_output_len=24,
    )
    rows = pq.read_table(pqt).to_pylist()
    assert len(rows) == 16
    for policy in ("continuous", "static"):
        got = [
            (r["id"], r["prompt_tokens"], r["output_len"], r["output_tokens"])
            for r in rows
            if r["policy"] == policy
        ]
        assert got == [(e.request_id, e.prompt_len, e.output_len, e.output_len) for e in expected]
    assert all(
        r["finish_reason"] == "length" and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        for r in rows
    )
    assert doc["results"]["static"]["output_tokens"] == sum(e.output_len for e in expected)

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    image = plt.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_bench_request_rate_and_sweep(model_dir: Path, tmp_path: Path) -> None:
    js, pqt = tmp_path / "s.json", tmp_path / "s.parquet"
    invoke(
        "--model",
        str(model_dir),
        *COMMON,
        "--workload",
        "random",
        "--num-prompts",
        "6",
        "--input-len",
        "24",
        "--output-len",
        "4",
        "--request-rate",
        "40",
        "--seed",
        "7",
        "--sweep",
        "max_num_seqs=1,4",
        "--output-json",
        str(js),
        "--output-parquet",
        str(pqt),
    )
    doc = json.loads(js.read_text())
    assert list(doc["results"]) == ["max_num_seqs=1", "max_num_seqs=4"]
    assert doc["results"]["max_num_seqs=1"]["slots"] == 1
    assert doc["results"]["max_num_seqs=4"]["overrides"] == {"max_num_seqs": 4}
    assert doc["workload"]["request_rate"] == 40
    rows = pq.read_table(pqt).to_pylist()
    expected = poisson_arrivals(6, 40.0, seed=7)
    for run in ("max_num_seqs=1", "max_num_seqs=4"):
        arrivals = [r["arrival_s"] for r in rows if r["run"] == run]
        assert arrivals == pytest.approx(expected)
        assert all(r["queue_s"] >= 0 and r["output_tokens"] == 4 for r in rows if r["run"] == run)
    assert np.all(np.diff(expected) > 0)


def test_bench_rejects_bad_options(model_dir: Path) -> None:
    app = typer.Typer()
    app.command()(bench)
    for args in (
        ["--workload", "nope"],
        ["--policy", "batchy"],
        ["--workload", "file"],
        ["--sweep", "model=a"],
    ):
        result = CliRunner().invoke(app, ["--model", str(model_dir), *COMMON, *args])
        assert result.exit_code == 2, args
        assert "error:" in result.output
