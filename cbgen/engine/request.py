"""Request: one prompt's life in the engine, under the one-counter model.

    all_token_ids:  | prompt ............ | output ...... |
                    |<- num_computed_tokens ->|<- to do ->|
                                              ^ KV cache holds everything left of here

Each step the scheduler grants `num_new_tokens <= num_tokens - num_computed_tokens`. A request
samples when it has caught up (`num_computed_tokens == num_tokens` after the step). Prefill,
chunked prefill, decode and recompute after preemption are the same rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cbgen.engine.logprobs import PositionLogprobs
from cbgen.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    # Timings, all from one monotonic clock (time.perf_counter).
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if any."""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    """One per output token when sampling_params.logprobs is set."""
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    """Prompt tokens 1.. when sampling_params.prompt_logprobs is set (token 0 has none)."""

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.token_times.append(now)
