"""Prompt logprobs (SamplingParams.prompt_logprobs): which prompt tokens a step's positions
score, for each request that asks, and how far each request has got.

The logits at position p score token p + 1; the last prompt position samples the first output
token instead:

    prompt      t0   t1   t2  ...  t[P-1] | out0
    position    0    1    2   ...  P-1
    scores      t1   t2   t3  ...  (samples out0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cbgen.engine.logprobs import PositionLogprobs
from cbgen.engine.sampler import position_logprobs
from cbgen.engine.scheduler import SchedulerOutput

PROMPT_LOGITS_ROWS = 256
"""Prompt positions per LM-head call when scoring a prompt: bounds the logits tensor."""

PromptOf = Callable[[str], tuple[Sequence[int], int, int]]
"""A request's (token ids, prompt length, top entries asked per position)."""


class PromptScorer:
    """The requests with prompt_logprobs and the prompt tokens scored so far for each (the
    first counts: it has no logprob). Kept through preemption, so a recompute scores nothing
    twice."""

    def __init__(self) -> None:
        self.scored: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.scored)

    def add(self, request_id: str) -> None:
        self.scored[request_id] = 1

    def forget(self, request_id: str) -> None:
        self.scored.pop(request_id, None)

    def score(
        self,
        out: SchedulerOutput,
        hidden: torch.Tensor,
        prompt_of: PromptOf,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, list[PositionLogprobs]]:
        """Logprobs of the prompt tokens this step's positions predict (hidden: every position
        of the flat batch). A chunk [c, c + n) scores tokens c + 1 .. min(c + n, P - 1), those
        not scored before (a recompute after preemption starts again at 0)."""
        index: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        owners: list[tuple[str, int]] = []  # (request, number of its rows in index)
        start = 0
        for s in out.scheduled:
            rid, c = s.request_id, s.num_computed_tokens
            scored = self.scored.get(rid)
            if scored is not None:
                token_ids, prompt_len, top = prompt_of(rid)
                lo = max(c, scored - 1)
                hi = min(c + s.num_new_tokens, prompt_len - 1)
                if lo < hi:
                    index.extend(range(start + lo - c, start + hi - c))
                    targets.extend(token_ids[lo + 1 : hi + 1])
                    num_top.extend([top] * (hi - lo))
                    owners.append((rid, hi - lo))
                    self.scored[rid] = hi + 1
            start += s.num_new_tokens
        if not index:
            return {}
        measured: list[PositionLogprobs] = []
        for a in range(0, len(index), PROMPT_LOGITS_ROWS):
            b = a + PROMPT_LOGITS_ROWS
            logits = compute_logits(hidden[index[a:b]])
            measured += position_logprobs(logits, targets[a:b], num_top[a:b])
        result = {}
        first = 0
        for rid, n in owners:
            result[rid] = measured[first : first + n]
            first += n
        return result
