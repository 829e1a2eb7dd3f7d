"""Log-probabilities of chosen tokens and their top alternatives: what the runner measures at
one position (token ids only) and what the engine hands out (with each token's text).

No torch here: requests hold these, and the scheduler, which imports requests, stays
torch-free. The numbers come from sampler.position_logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PositionLogprobs:
    """One position: the log-probability of the token that followed it (sampled, or the next
    prompt token) and the top entries, best first."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str | None
    """The token's text, alone (None when the model has no tokenizer)."""
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str | None
    logprob: float
    top_logprobs: list[TopLogprob]
    """Best first; empty when the request asked for 0 top entries."""


def with_text(
    positions: Sequence[PositionLogprobs], text: Callable[[int], str | None]
) -> list[TokenLogprob]:
    """The positions with each token's text (text(token_id))."""
    return [
        TokenLogprob(
            p.token_id,
            text(p.token_id),
            p.logprob,
            [TopLogprob(t, text(t), lp) for t, lp in zip(p.top_ids, p.top_logprobs, strict=True)],
        )
        for p in positions
    ]
