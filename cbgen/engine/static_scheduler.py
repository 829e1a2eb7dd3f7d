"""Static (request-level) batching, kept for comparison with continuous batching.

What request-level batching (one padded batch at a time, as `generate` on a padded tensor
does) really costs, reproduced on the paged engine and measured rather than estimated:

  admission  a batch of up to static_batch_size waiting requests (FCFS) starts only when the
             previous batch has fully finished, and only as many as the KV cache holds for
             the whole padded batch run to its end, so a static batch is never preempted;
  prompts    padded to the longest: member i's padding (Lmax - L_i tokens) is a pad sequence
             whose tokens are really computed (every layer, attention over itself) and whose
             KV blocks stay held until the batch ends, as a padded row's would;
  outputs    every member computes one token per step until the slowest member has finished:
             a member that is done keeps its slot and keeps computing, its samples discarded;
             the results of a batch are returned together when the batch ends.

                 step  1 (prefill)   2   3   4   5   6
      pad(a)         |####|                              pad: computed, never sampled
      a              |#####|         x   x   x   -   -   x: useful token  -: discarded
      b              |#########|     x   -   -   -   -
      pad(c)         |######|
      c              |###|           x   x   x   x   x   the slowest member ends the batch

A pad sequence never samples: a pad of P tokens is a request of P + 1 tokens that is only ever
granted its first P, so `num_computed_tokens + num_new == num_tokens` never holds for it. It
needs no sampling state in the runner; it holds a runner row only while it computes (released
through finished_ids as soon as its P tokens are in) and its KV blocks until the batch ends.
Pads come first in a batch's order, so the members' first tokens come at the end of the
padded prefill, as they do when the whole padded batch is one forward pass.

Padding waste = (pad tokens + tokens computed by members already done) / all tokens computed,
counted from what was scheduled (PaddingStats).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from cbgen.engine.block_pool import KVCacheBlock
from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.request import Request, RequestStatus
from cbgen.engine.scheduler import Scheduler, SchedulerOutput, _StepBuilder

PAD_TOKEN_ID = 0
"""The token a pad sequence is made of (any id in the vocabulary would do)."""
PAD_ID_PREFIX = "\x00static-pad/"
"""Request ids of pad sequences; the NUL byte keeps them apart from any user id."""


@dataclass
class PaddingStats:
    """Tokens computed under the static policy, split by what they were for."""

    num_computed_tokens: int = 0
    """Every token computed (pads, members' prompts, decodes useful or discarded)."""
    num_pad_tokens: int = 0
    """Prompt padding computed."""
    num_discarded_tokens: int = 0
    """Tokens computed by members that had already finished (their samples are dropped)."""
    num_batches: int = 0

    @property
    def num_wasted_tokens(self) -> int:
        return self.num_pad_tokens + self.num_discarded_tokens

    @property
    def waste(self) -> float:
        """Share of the computed tokens that were padding (0 when nothing was computed)."""
        return (
            self.num_wasted_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0
        )

    def since(self, earlier: PaddingStats) -> PaddingStats:
        """What was counted after the snapshot `earlier` of the same counters was taken."""
        return PaddingStats(
            self.num_computed_tokens - earlier.num_computed_tokens,
            self.num_pad_tokens - earlier.num_pad_tokens,
            self.num_discarded_tokens - earlier.num_discarded_tokens,
            self.num_batches - earlier.num_batches,
        )


@dataclass
class _Batch:
    index: int
    members: list[Request]
    pads: dict[str, Request]
    order: list[Request]
    """Pads first, then members in FCFS order: the order in which work is granted each step."""
    max_tokens: int
    """The most tokens a member may generate (the batch's largest max_tokens)."""
    max_len: int
    """The longest a member's sequence may grow: a done member computes discarded tokens
    while it is shorter than min(its prompt + max_tokens, max_len), within its KV reservation
    and within the model's length."""
    done: dict[str, RequestStatus] = field(default_factory=dict)
    """Members that have finished but keep computing until the batch ends."""
    emitted: set[str] = field(default_factory=set)
    """Done members the engine already handed out (stopped by a stop string)."""

    @property
    def is_over(self) -> bool:
        return all(m.request_id in self.done for m in self.members)


class StaticScheduler(Scheduler):
    """Request-level batching: one padded batch at a time (see the module docstring)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        *,
        static_batch_size: int = 8,
        max_model_len: int | None = None,
    ) -> None:
        """static_batch_size: the most members of a batch (and at most max_num_seqs).
        max_model_len: the longest a sequence may grow; a batch is formed only while its
        longest prompt plus its largest max_tokens fits, as a padded row must. When None, a
        done member stops computing once it is as long as the longest prompt + max_tokens of
        any member (a length every request was checked against), so a rare member idles
        rather than computes its last discarded tokens."""
        super().__init__(kv_cache, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.static_batch_size = static_batch_size
        self.max_model_len = max_model_len
        self.batch: _Batch | None = None
        self.padding = PaddingStats()
        self._rows: set[str] = set()
        """Ids that hold a runner row: admitted pads and members, until released."""

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.kv.new_step()
        step = _StepBuilder(budget=self.max_num_batched_tokens)
        if self.batch is None and self.waiting:
            self.batch = self._form_batch(now)
        if self.batch is not None:
            self._schedule_batch(step)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            preempted_ids=(),
            finished_ids=finished,
            num_prefill_tokens=step.prefill,
            num_decode_tokens=step.decode,
            num_cached_tokens=step.cached,
        )

    def _form_batch(self, now: float) -> _Batch:
        """Take up to static_batch_size waiting requests, FCFS, while the padded batch fits."""
        size = min(self.static_batch_size, self.max_num_seqs)
        members: list[Request] = []
        for req in itertools.islice(self.waiting, size):
            if members and not self._fits([*members, req]):
                break
            members.append(req)
        for _ in members:
            self.waiting.popleft()
        longest = max(m.num_tokens for m in members)
        max_tokens = max(m.sampling_params.max_tokens for m in members)
        index = self.padding.num_batches
        self.padding.num_batches += 1
        pads: dict[str, Request] = {}
        for m in members:
            num_pad = longest - m.num_tokens
            if num_pad:
                rid = f"{PAD_ID_PREFIX}{index}/{m.request_id}"
                pads[rid] = Request(
                    request_id=rid,
                    prompt_token_ids=[PAD_TOKEN_ID] * (num_pad + 1),  # the last is never granted
                    sampling_params=m.sampling_params,
                    arrival_time=now,
                )
            m.status = RequestStatus.RUNNING
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now  # the batch starts: its members leave the queue
        self.running.extend(members)
        if self.max_model_len is not None:
            max_len = self.max_model_len
        else:
            max_len = max(m.num_tokens + m.sampling_params.max_tokens for m in members)
        return _Batch(index, members, pads, [*pads.values(), *members], max_tokens, max_len)

    def _fits(self, members: list[Request]) -> bool:
        """Whether the padded batch, run to its end, fits the KV cache and the model length."""
        longest = max(m.num_tokens for m in members)
        max_tokens = max(m.sampling_params.max_tokens for m in members)
        if self.max_model_len is not None and longest + max_tokens > self.max_model_len:
            return False
        need = sum(
            self.kv.blocks_needed(m.num_tokens + max_tokens)
            + self.kv.blocks_needed(longest - m.num_tokens)
            for m in members
        )
        return need <= self.kv.num_free_blocks

    def _schedule_batch(self, step: _StepBuilder) -> None:
        batch = self.batch
        assert batch is not None
        for req in batch.order:
            if step.budget <= 0:
                break
            rid = req.request_id
            is_pad = rid in batch.pads
            if is_pad:
                remaining = req.num_tokens - 1 - req.num_computed_tokens
            elif rid in batch.done:
                # One discarded token a step, while the sequence stays within its reservation.
                cap = min(req.num_prompt_tokens + batch.max_tokens, batch.max_len)
                remaining = req.num_tokens - req.num_computed_tokens if req.num_tokens < cap else 0
            else:
                remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0:
                continue
            admitted = rid in self._rows
            if not admitted and len(self._rows) >= self.max_num_seqs:
                break  # no runner row until a pad has finished computing; keep the order
            computed_blocks: list[KVCacheBlock] = []
            num_cached = num_partial = 0
            partial = None
            if not admitted and not is_pad:
                computed_blocks, num_cached = self.kv.get_computed_blocks(req)
                partial = self.kv.get_partial_block(req, computed_blocks)
                num_partial = partial[1] if partial else 0
                num_cached += num_partial
                remaining -= num_cached
            num_new = min(remaining, step.budget)
            if not self.enable_chunked_prefill and num_new < remaining:
                break
            new_blocks = self.kv.allocate_slots(req, num_new, computed_blocks, num_partial)
            if new_blocks is None:
                raise RuntimeError(
                    f"static batch {batch.index}: KV cache ran out despite its reservation"
                )
            if not admitted:
                self._rows.add(rid)
                if not is_pad:
                    req.num_computed_tokens = num_cached
                    req.num_cached_tokens = num_cached
                    step.cached += num_cached
            copy = (
                (partial[0].block_id, new_blocks[len(computed_blocks)], num_partial)
                if partial
                else None
            )
            step.add(req, num_new, new_blocks, readmitted=not admitted, kv_copy=copy)

    # ---- after the forward pass -----------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        now: float,
    ) -> list[Request]:
        """Advance counters and append useful tokens; returns the whole batch when it ends."""
        batch = self.batch
        if batch is None:
            return []
        for s in output.scheduled:
            rid, n = s.request_id, s.num_new_tokens
            self.padding.num_computed_tokens += n
            pad = batch.pads.get(rid)
            if pad is not None:
                pad.num_computed_tokens += n
                self.padding.num_pad_tokens += n
                if pad.num_computed_tokens == pad.num_tokens - 1:
                    self._release_row(rid)  # its KV blocks stay held until the batch ends
                continue
            req = self.requests[rid]
            req.num_computed_tokens += n
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if rid in batch.done:
                self.padding.num_discarded_tokens += n
                if s.will_sample:
                    req.all_token_ids.append(sampled[rid])  # computed next step, never returned
                continue
            if not s.will_sample:
                continue
            token = sampled[rid]
            req.append_output_token(token, now)
            status = self._check_stop(req, token)
            if status is not None:
                batch.done[rid] = status
        if batch.is_over:
            return self._end_batch(now)
        return []

    def _release_row(self, rid: str) -> None:
        if rid in self._rows:
            self._rows.discard(rid)
            self._finished_ids.append(rid)

    def _end_batch(self, now: float) -> list[Request]:
        batch = self.batch
        assert batch is not None
        for m in batch.members:
            m.status = batch.done[m.request_id]
        result = [m for m in batch.members if m.request_id not in batch.emitted]
        self._release_pads(batch)
        for m in batch.members:
            self._rows.discard(m.request_id)
        self.batch = None
        super().finish(batch.members, now)
        return result

    def _release_pads(self, batch: _Batch) -> None:
        for rid, pad in batch.pads.items():
            self.kv.free(pad)
            self._release_row(rid)

    def finish(
        self, requests: Iterable[Request], now: float, status: RequestStatus | None = None
    ) -> None:
        """Aborts leave the batch at once. A member the engine stopped (a stop string) is
        handed out by the engine now, but keeps its slot and keeps computing until the batch
        ends, as the rest of its padded row would."""
        requests = list(requests)
        batch = self.batch
        member_ids = {m.request_id for m in batch.members} if batch is not None else set()
        outside = [r for r in requests if r.request_id not in member_ids]
        inside = [r for r in requests if r.request_id in member_ids]
        if outside:
            super().finish(outside, now, status)
        if batch is None or not inside:
            return
        if status is None:
            for r in inside:
                batch.done[r.request_id] = r.status
                batch.emitted.add(r.request_id)
                r.finished_time = now
            return
        gone = {r.request_id for r in inside}
        for rid in gone:
            self._rows.discard(rid)
        batch.members = [m for m in batch.members if m.request_id not in gone]
        batch.order = [r for r in batch.order if r.request_id not in gone]
        super().finish(inside, now, status)
        if not batch.members:
            self._release_pads(batch)
            self.batch = None
