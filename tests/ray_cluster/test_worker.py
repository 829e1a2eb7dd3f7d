"""The engine actor without a cluster: EngineActor (and the EngineWorker inside it) in this
process, fed and drained through its exchange call as the --ray driver does. Rows join a running
engine as they arrive; resume keys and bad rows end as they do in a local run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cbgen.config import EngineConfig, SamplingParams
from cbgen.io.parse import parse_mapping
from cbgen.io.rows import ColumnSpec, InputRow
from cbgen.io.writer import row_key
from cbgen.ray.actor import EngineActor, Reply


def _row(index: int, **fields: object) -> InputRow:
    return parse_mapping(
        {"id": f"r{index}", **fields}, index, f"line {index + 1}", ColumnSpec(), keep={}
    )


@pytest.fixture
def actor(chat_model: Path) -> Iterator[EngineActor]:
    config = EngineConfig(
        model=str(chat_model),
        load_format="dummy",
        num_threads=1,
        kv_cache_memory=16 << 20,
        max_num_seqs=4,
    )
    engine_actor = EngineActor(config, SamplingParams(temperature=0, max_tokens=4))
    yield engine_actor
    engine_actor.close()


def _drain(actor: EngineActor, rows: int, total: Reply, timeout: float = 120) -> Reply:
    """Exchanges (with no rows) until `rows` rows have finished, counting those in `total`
    (the reply to the exchange that sent them)."""
    deadline = time.monotonic() + timeout
    while len(total.finished) < rows:
        assert time.monotonic() < deadline, total.finished
        reply = actor.exchange([])
        total.records += reply.records
        total.finished += reply.finished
        total.snapshot = reply.snapshot
    return total


def test_rows_join_a_running_engine_without_waiting_for_the_first_ones(
    actor: EngineActor,
) -> None:
    """Two long rows run; two short ones sent while they run finish long before them: a row
    takes a free slot at the next step, no batch drains before the next begins (the long rows
    are dropped when the actor closes)."""
    long = [_row(i, prompt=f"long {i}", max_tokens=1500, ignore_eos=True) for i in (0, 1)]
    short = [_row(i, prompt=f"short {i}", max_tokens=2, ignore_eos=True) for i in (2, 3)]
    assert actor.exchange([(r, ()) for r in long]).finished == []
    got = _drain(actor, 2, actor.exchange([(r, ()) for r in short]))
    assert sorted(got.finished) == [(2, "ok"), (3, "ok")]
    assert sorted(r["row"] for r in got.records) == [2, 3]


def test_resume_keys_bad_rows_and_samples(actor: EngineActor) -> None:
    rows = [
        (_row(10, prompt="two samples", n=2, temperature=1.0), (row_key("r10", 0),)),
        (_row(11, prompt="done before"), (row_key("r11", 0),)),
        (_row(12, prompt=""), ()),  # an empty prompt: an error row
        (_row(13, prompt="plain"), ()),
    ]
    got = _drain(actor, 4, actor.exchange(rows))
    assert sorted(got.finished) == [(10, "ok"), (11, "resumed"), (12, "failed"), (13, "ok")]
    by_row = {(r["row"], r["sample_index"]): r for r in got.records}
    assert sorted(by_row) == [(10, 1), (12, 0), (13, 0)]  # sample 0 of row 10 was written before
    assert by_row[(12, 0)]["finish_reason"] == "error"
    assert by_row[(12, 0)]["error"] == "line 13: prompt: is empty"
    assert by_row[(13, 0)]["completion_tokens"] == 4
    assert got.snapshot is not None and got.snapshot.rows_failed >= 1
