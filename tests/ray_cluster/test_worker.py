"""The engine actor without a cluster: EngineActor (and the EngineWorker inside it) in this
process, fed and drained through its exchange call as the --ray driver does. Rows join a running
engine as they arrive; resume keys and bad rows end as they do in a local run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cbgen.config import EngineConfig
from cbgen.io.parse import parse_mapping
from cbgen.io.rows import ColumnSpec, InputRow
from cbgen.io.writer import row_key
from cbgen.ray import worker as worker_module
from cbgen.ray.actor import EngineActor, Reply
from cbgen.sampling_params import SamplingParams


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


def test_the_engine_is_built_and_stepped_in_its_own_thread(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kernel of the engine runs in one thread, its loop's: an OpenMP team kept by a
    second thread (the caller's, had it built the engine) makes the loop's team sleep after
    each parallel region instead of spinning: 5-11 % of a run under Ray."""
    threads: list[tuple[str, int]] = []

    class Recorded(worker_module.Engine):
        def __init__(self, config: EngineConfig) -> None:
            threads.append(("build", threading.get_ident()))
            super().__init__(config)

        def step(self) -> Any:
            threads.append(("step", threading.get_ident()))
            return super().step()

    monkeypatch.setattr(worker_module, "Engine", Recorded)
    config = EngineConfig(
        model=str(chat_model), load_format="dummy", num_threads=1, kv_cache_memory=16 << 20
    )
    actor = EngineActor(config, SamplingParams(temperature=0, max_tokens=2))
    try:
        got = _drain(actor, 1, actor.exchange([(_row(0, prompt="hello"), ())]))
    finally:
        actor.close()
    assert got.finished == [(0, "ok")]
    assert threads[0][0] == "build" and any(kind == "step" for kind, _ in threads)
    assert {ident for _, ident in threads} == {actor.worker._thread.ident}
    assert actor.worker._thread.ident != threading.get_ident()


def test_an_engine_that_cannot_be_built_fails_the_constructor(tmp_path: Path) -> None:
    """The engine is built in the loop's thread; what stops it is raised where the actor is
    made (Ray's actor_init_failed), not left in a thread."""
    config = EngineConfig(model=str(tmp_path / "no-such-model"), load_format="dummy")
    with pytest.raises(Exception, match="no-such-model"):
        EngineActor(config, SamplingParams(temperature=0, max_tokens=2))
