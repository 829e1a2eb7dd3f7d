"""`cbgen bench` (placeholder until the command lands)."""

from __future__ import annotations


def bench() -> None:
    """Benchmark continuous against static batching."""
    raise SystemExit(2)
