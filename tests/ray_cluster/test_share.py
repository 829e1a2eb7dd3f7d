"""How many rows the --ray driver lets one engine hold (_Driver._share), without a cluster: an
equal part of the rows left when the input's size is known, engines still loading counted for a
while after the first is ready, the 3 x max_num_seqs depth otherwise."""

from __future__ import annotations

import time
from typing import Any

from cbgen.io.progress import ProgressTracker
from cbgen.ray.actor import EngineInfo
from cbgen.ray.driver import START_GRACE_S, _Driver, _Engine

READY = EngineInfo("engine", 1.0, {}, 1, "host")


def _driver(total: int | None, done: int, engines: list[_Engine], since_first: float) -> Any:
    d: Any = object.__new__(_Driver)  # only the fields _share reads
    d.depth = 24
    d.tracker = ProgressTracker(8, total)
    d.tracker.rows_done = done
    d.engines = engines
    d.first_ready = time.monotonic() - since_first
    return d


def test_a_known_input_is_shared_between_the_engines() -> None:
    ready, loading = _Engine(0, None, "call", READY), _Engine(1, None, "call")
    assert _Driver._share(_driver(13, 0, [ready, loading], 0.0)) == 7
    assert _Driver._share(_driver(13, 7, [ready, loading], 0.0)) == 3
    # an engine still loading long after the first was ready no longer holds rows back
    assert _Driver._share(_driver(13, 7, [ready, loading], START_GRACE_S + 1)) == 6
    # two ready engines, a large input: the depth bounds each
    assert _Driver._share(_driver(10_000, 0, [ready, _Engine(1, None, "c", READY)], 0.0)) == 24
    # an engine lost for good (no call) is not waited for
    assert _Driver._share(_driver(13, 0, [ready, _Engine(1, None)], 0.0)) == 13


def test_a_stream_of_unknown_size_fills_to_the_depth() -> None:
    ready = _Engine(0, None, "call", READY)
    assert _Driver._share(_driver(None, 0, [ready, _Engine(1, None, "call")], 0.0)) == 24
    assert _Driver._share(_driver(3, 3, [ready], 0.0)) == 1  # never 0: retries still go out
