"""The Ray Data processor (cbgen.ray.build_processor) on the session's local Ray cluster: rows of
a Dataset through preprocess, cbgen's engine and postprocess, giving the rows a local `cbgen run`
gives for the same input, bad rows as error rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.cli import read_rows, run, tiny, write_jsonl

from cbgen.config import EngineConfig
from cbgen.sampling_params import SamplingParams

pytestmark = [pytest.mark.xdist_group("ray")]  # one worker, one cluster

ROWS: list[dict[str, Any]] = [
    {"qid": f"q{i}", "question": f"Question {i}: what is {i} + {i}?", "max_tokens": 2 + i % 3}
    for i in range(9)
]
ROWS[4] = {"qid": "q4", "question": "", "max_tokens": 3}  # an empty prompt: an error row
ROWS[7] = {"qid": "q7", "question": "Sample me", "max_tokens": 4, "temperature": 1.0, "row": 7}


def test_a_dataset_through_the_processor_gives_the_local_run_s_rows(
    tmp_path: Path, chat_model: Path, ray_cluster: str
) -> None:
    import ray

    from cbgen.ray import build_processor

    def pre(r: dict[str, Any]) -> dict[str, Any]:
        out = {"id": r["qid"], "prompt": r["question"], "max_tokens": r["max_tokens"]}
        return out | {k: r[k] for k in ("temperature", "row") if r.get(k) is not None}

    processor = build_processor(
        EngineConfig(
            model=str(chat_model), load_format="dummy", kv_cache_memory=16 << 20, max_num_seqs=4
        ),
        SamplingParams(temperature=0, max_tokens=4),
        concurrency=1,
        cpus_per_engine=1,
        batch_size=2,
        preprocess=pre,
        postprocess=lambda r: {**r, "answer": r["completion"]},
    )
    dataset = ray.data.from_items(ROWS, override_num_blocks=3)
    got = sorted(processor(dataset).take_all(), key=lambda r: r["id"])

    src = write_jsonl(tmp_path / "in.jsonl", [pre(r) for r in ROWS])
    local = run(["run", str(src), "-o", str(tmp_path / "local.parquet"), *tiny(chat_model)])
    assert local.returncode == 0, local.stderr
    want = sorted(read_rows(tmp_path / "local.parquet"), key=lambda r: r["id"])
    same = ("id", "completion", "completion_tokens", "finish_reason", "prompt_tokens")
    assert [{k: g[k] for k in same} for g in got] == [{k: w[k] for k in same} for w in want]
    assert [g["answer"] for g in got] == [w["completion"] for w in want]
    failed = [g for g in got if g["finish_reason"] == "error"]
    assert [(g["id"], g["error"]) for g in failed] == [("q4", "id q4: prompt: is empty")]
    assert {g["prompt"] for g in got} == {r["question"] for r in ROWS}  # input columns kept
    assert [g["row"] for g in got if g["id"] == "q7"] == [7]  # the row's own row index
