"""Static (request-level) batching, kept for comparison with continuous batching.

A batch of up to static_batch_size requests is admitted only when the previous batch has
fully finished; nobody joins a batch in flight.
"""

from __future__ import annotations

from cbgen.engine.scheduler import Scheduler, _StepBuilder


class StaticScheduler(Scheduler):
    static_batch_size: int = 8

    def _admit(self, step: _StepBuilder, now: float) -> None:
        if self.running:
            return
        saved = self.max_num_seqs
        self.max_num_seqs = min(saved, self.static_batch_size)
        try:
            super()._admit(step, now)
        finally:
            self.max_num_seqs = saved
