"""cbgen.phases: each phase heard as it begins and as it ends with its own seconds (nested
phases left out), by the listeners of the moment only; StartupTimes adds up the kinds. Times
come from a clock the test moves, never from the wall."""

from __future__ import annotations

import pytest

from cbgen import phases
from cbgen.phases import BUILD, LOAD, TUNE, StartupTimes, listening, phase


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    return now


def test_a_listener_hears_each_phase_begin_and_end_with_its_own_seconds(
    clock: list[float],
) -> None:
    heard: list[tuple[str, str, float | None]] = []
    with listening(lambda *event: heard.append(event)), phase(LOAD, "preparing the model"):
        clock[0] += 2.0
        with phase(TUNE, "tuning"):
            clock[0] += 5.0
        clock[0] += 1.0
    assert heard == [
        (LOAD, "preparing the model", None),
        (TUNE, "tuning", None),
        (TUNE, "tuning", 5.0),
        (LOAD, "preparing the model", 3.0),  # the 5 s of tuning inside it are tuning's
    ]


def test_a_phase_that_raises_still_ends_and_nobody_hears_outside_listening(
    clock: list[float],
) -> None:
    heard: list[tuple[str, str, float | None]] = []
    with phase(BUILD, "unheard"):
        clock[0] += 1.0
    with listening(lambda *event: heard.append(event)):
        with pytest.raises(RuntimeError), phase(BUILD, "compiling"):
            clock[0] += 4.0
            raise RuntimeError("cc failed")
        with phase(LOAD, "after the failure"):  # the nesting count did not leak
            clock[0] += 1.0
    with phase(LOAD, "unheard too"):
        pass
    assert heard == [
        (BUILD, "compiling", None),
        (BUILD, "compiling", 4.0),
        (LOAD, "after the failure", None),
        (LOAD, "after the failure", 1.0),
    ]


def test_startup_times_add_up_by_kind_and_the_rest_is_other(clock: list[float]) -> None:
    times = StartupTimes()
    with listening(times.record):
        with phase(BUILD, "building"):
            clock[0] += 20.0
        with phase(LOAD, "loading"):
            clock[0] += 1.5
        with phase(LOAD, "preparing"):
            clock[0] += 0.5
            with phase(TUNE, "tuning"):
                clock[0] += 25.0
    assert times.as_dict(48.0) == {
        "total": 48.0,
        "build": 20.0,
        "tune": 25.0,
        "load": 2.0,
        "other": 1.0,
    }
    assert StartupTimes().as_dict(3.0) == {
        "total": 3.0,
        "build": 0.0,
        "tune": 0.0,
        "load": 0.0,
        "other": 3.0,
    }
