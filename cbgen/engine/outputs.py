"""What the engine hands out: finished requests and per-step stats. Readers only."""

from __future__ import annotations

from dataclasses import dataclass

from cbgen.engine.logprobs import TokenLogprob
from cbgen.metrics import RequestMetrics


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    """stop | length | error | abort"""
    error: str | None
    num_preemptions: int
    num_cached_tokens: int
    stop_reason: str | int | None
    metrics: RequestMetrics
    sample_index: int = 0
    """Which of a prompt's n samples this is."""
    logprobs: list[TokenLogprob] | None = None
    """One per output token (the stop token included) when logprobs were asked for."""
    cumulative_logprob: float | None = None
    """The sum of those logprobs."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token, None for the first, when prompt_logprobs were asked for."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class StepStats:
    time: float
    """When the step ended (monotonic clock)."""
    duration_s: float
    num_scheduled: int
    """Requests that computed tokens in this step (slots in use)."""
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preempted: int
    """Preemptions in this step."""
    total_preemptions: int
    num_prefill_tokens: int
    """Tokens scheduled this step for requests that did not sample (prompt chunks, recompute)
    plus the prompt tails that did; i.e. every scheduled token that is not a decode."""
    num_decode_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache this step."""

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(self.num_kv_blocks_total, 1)


@dataclass(frozen=True)
class StepOutput:
    finished: list[RequestOutput]
    stats: StepStats
