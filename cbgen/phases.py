"""Start-up phases: what a process is doing before it can generate (building the CPU kernels,
tuning them, loading the model), announced as each begins and timed when it ends.

The code that does the work says so where it does it, and only when it does it (a cached build
announces nothing):

    with phase(BUILD, "building CPU kernels for x86-64 znver4 ...: first use, cached"):
        compile ...

Whoever shows progress listens for the length of a start-up, and StartupTimes adds up the
seconds of each kind for the summary:

    times = StartupTimes()
    with listening(times.record, display.phase):
        engine = Engine(config)
    times.as_dict(engine.init_time_s)   # {"total": 48.2, "build": 20.1, "tune": 25.3, ...}

A listener is called as listener(kind, text, None) when a phase begins and
listener(kind, text, seconds) when it ends, from the thread that runs it; seconds are the
phase's own, the phases nested in it left out (a tuning pass inside the model's preparation
counts as tuning only), so the kinds add up to no more than the whole. One module owns this,
below every layer, so that the kernel layer (which imports nothing else of cbgen) reports
without knowing who listens; with nobody listening a phase costs two clock reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

BUILD = "build"
"""Compiling the CPU kernels (first use of a compiler, ISA and sources on this machine)."""
TUNE = "tune"
"""Timing the kernels' paths to choose their thresholds (first use of a build)."""
LOAD = "load"
"""Reading the tokenizer and the weights, and preparing them for the device."""
KINDS = (BUILD, TUNE, LOAD)

Listener = Callable[[str, str, "float | None"], None]
"""listener(kind, text, seconds): seconds None when the phase begins, its own time at its end."""

_listeners: list[Listener] = []
_lock = threading.Lock()
_nested = threading.local()
"""Per thread: the seconds of finished phases nested in each phase now running (a stack)."""


def _call(kind: str, text: str, seconds: float | None) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(kind, text, seconds)


@contextmanager
def phase(kind: str, text: str) -> Iterator[None]:
    """Announce `text` (one of KINDS), run the block, report its own seconds (also when the
    block raises)."""
    stack: list[float] = _nested.__dict__.setdefault("stack", [])
    _call(kind, text, None)
    t0 = time.perf_counter()
    stack.append(0.0)
    try:
        yield
    finally:
        took = time.perf_counter() - t0
        inner = stack.pop()
        if stack:
            stack[-1] += took
        _call(kind, text, max(0.0, took - inner))


@contextmanager
def listening(*listeners: Listener) -> Iterator[None]:
    """Call these listeners for every phase begun or ended inside the block (any thread)."""
    with _lock:
        _listeners.extend(listeners)
    try:
        yield
    finally:
        with _lock:
            for listener in listeners:
                _listeners.remove(listener)


@dataclass
class StartupTimes:
    """Seconds of each kind of phase, added up as they end (a Listener: record)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, kind: str, text: str, seconds: float | None) -> None:
        if seconds is not None:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def as_dict(self, total_s: float) -> dict[str, float]:
        """{"total": total_s, each of KINDS (0 when none ran), "other": the rest}: the
        summary's startup_s."""
        kinds = {k: self.seconds.get(k, 0.0) for k in KINDS}
        return {"total": total_s, **kinds, "other": max(0.0, total_s - sum(kinds.values()))}
