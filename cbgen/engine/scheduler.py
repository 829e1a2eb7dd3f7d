"""Token-budget scheduler: running first, then FCFS admission; chunked prefill; preemption.

Each step every request is granted some new tokens so that num_computed_tokens catches up
with num_tokens (see request.py). The order of work in one step:

  1. running requests, in admission order: a decode is 1 token; a prompt gets what is left of
     the token budget (a chunk). Under a sliding window in every layer, the blocks its window
     has left behind are released first (KVCacheManager.free_out_of_window), so a long
     generation holds a bounded number of blocks. When the KV cache has no room, the most recently admitted
     running request is preempted (blocks freed, num_computed_tokens = 0, back to the head of
     the queue) until there is room or the request itself was the victim;
  2. waiting requests, FCFS, while slots, tokens and blocks allow; nobody is admitted in a
     step that preempted (the freed blocks would be handed straight back and forth).
     Without chunked prefill a request is admitted only whole, except one that could never be
     whole in one step (a preempted request recomputing prompt + output longer than the
     budget): it is chunked, or it would block the queue for ever.

Full blocks enter the prefix cache as soon as they are scheduled: every backend writes a
layer's new K/V for the whole flat batch before any query attends, so a request admitted
later in the same step (another sample of the same prompt, say) can already share them. A
block scheduled in a step is never freed in that step: victims of preemption come from the
tail of the running list, which has not been scheduled yet.

The scheduler owns no tensors: it returns a SchedulerOutput of ids, token counts and block ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int
    """Tokens already in the KV cache before this step (cache hits included)."""
    num_new_tokens: int
    new_block_ids: tuple[int, ...]
    """Blocks appended to the request's block table this step (all of them for a new one)."""
    new_token_ids: tuple[int, ...] | None
    """All tokens (prompt + generated) when the request is (re)admitted this step, else None:
    the runner keeps its own copy of the tokens of running requests."""
    will_sample: bool
    """The request catches up this step, so a token is sampled for it."""
    kv_copy: tuple[int, int, int] | None = None
    """(source block, destination block, n): a partial prefix hit; the runner copies the first
    n tokens' K/V from source to destination before the step runs."""


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]
    """Requests that left since the last step: the runner drops their state."""
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _StepBuilder:
    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    prefill: int = 0
    decode: int = 0
    cached: int = 0

    def add(
        self,
        req: Request,
        num_new: int,
        new_blocks: list[int],
        readmitted: bool,
        kv_copy: tuple[int, int, int] | None = None,
    ) -> None:
        will_sample = req.num_computed_tokens + num_new == req.num_tokens
        self.scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                num_computed_tokens=req.num_computed_tokens,
                num_new_tokens=num_new,
                new_block_ids=tuple(new_blocks),
                new_token_ids=tuple(req.all_token_ids) if readmitted else None,
                will_sample=will_sample,
                kv_copy=kv_copy,
            )
        )
        self.budget -= num_new
        is_decode = (
            num_new == 1 and req.num_computed_tokens >= req.num_prompt_tokens and not readmitted
        )
        if is_decode:
            self.decode += 1
        else:
            self.prefill += num_new


class Scheduler:
    """Continuous (iteration-level) batching."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []

    # ---- queue -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.kv.new_step()
        step = _StepBuilder(budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit(step, now)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            preempted_ids=tuple(step.preempted),
            finished_ids=finished,
            num_prefill_tokens=step.prefill,
            num_decode_tokens=step.decode,
            num_cached_tokens=step.cached,
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
            self.kv.free_out_of_window(req)
            new_blocks = self.kv.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break  # req itself was preempted; everyone after it already was
            self.kv.cache_blocks(req, req.num_computed_tokens + num_new)
            step.add(req, num_new, new_blocks, readmitted=False)
            i += 1

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, step: _StepBuilder, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and step.budget > 0:
            req = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            partial = self.kv.get_partial_block(req, computed_blocks)
            num_partial = partial[1] if partial else 0
            num_cached += num_partial
            remaining = req.num_tokens - num_cached
            num_new = min(remaining, step.budget)
            if (
                not self.enable_chunked_prefill
                and num_new < remaining <= self.max_num_batched_tokens
            ):
                break  # wait for a step with room for all of it
            new_blocks = self.kv.allocate_slots(req, num_new, computed_blocks, num_partial)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.cached += num_cached
            self.kv.cache_blocks(req, req.num_computed_tokens + num_new)
            copy = (
                (partial[0].block_id, new_blocks[len(computed_blocks)], num_partial)
                if partial
                else None
            )
            step.add(req, num_new, new_blocks, readmitted=True, kv_copy=copy)

    # ---- after the forward pass -----------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        now: float,
    ) -> list[Request]:
        """Advance counters, append sampled tokens, finish requests that hit a stop rule.

        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for s in output.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += s.num_new_tokens
            if not s.will_sample:
                continue
            token = sampled[s.request_id]
            req.append_output_token(token, now)
            status = self._check_stop(req, token)
            if status is not None:
                req.status = status
                finished.append(req)
        if finished:
            self.finish(finished, now)
        return finished

    @staticmethod
    def _check_stop(req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n = req.num_output_tokens
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(
        self, requests: Iterable[Request], now: float, status: RequestStatus | None = None
    ) -> None:
        """Remove requests (finished, aborted) from the queues and free their blocks."""
        gone = set()
        for req in requests:
            if status is not None:
                req.status = status
            req.finished_time = now
            self.kv.free(req)
            gone.add(req.request_id)
            self.requests.pop(req.request_id, None)
            self._finished_ids.append(req.request_id)
        self.running = [r for r in self.running if r.request_id not in gone]
        if any(r.request_id in gone for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
