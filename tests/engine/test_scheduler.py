"""Scheduler + KV cache with a fake runner (helpers.scheduling): no model, no torch.

The fake runner plays the runner's side of the SchedulerOutput contract: it rebuilds every
request's tokens and block table from what the scheduler sends, simulates the KV cache as a
map slot -> "the prefix this slot's K/V was computed from", checks every context slot a
request attends to, and returns a chosen token for each request that samples.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from helpers.scheduling import (
    FakeRunner,
    default_token,
    make_request,
    make_scheduler,
    workloads,
)
from hypothesis import HealthCheck, example, given, settings

from cbgen.engine.request import Request, RequestStatus
from cbgen.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class Row:
    """What one request did in one step, for exact comparisons."""

    rid: str
    computed: int
    new: int
    blocks: tuple[int, ...]
    sample: bool
    admitted: bool


def rows(out: SchedulerOutput) -> list[Row]:
    return [
        Row(
            s.request_id,
            s.num_computed_tokens,
            s.num_new_tokens,
            s.new_block_ids,
            s.will_sample,
            s.new_token_ids is not None,
        )
        for s in out.scheduled
    ]


def check_step(
    sched: Scheduler,
    out: SchedulerOutput,
    running: list[str],
    waiting: list[str],
    num_tokens: dict[str, int],
) -> None:
    """The invariants of one step, given the queues and token counts just before it."""
    kv = sched.kv
    assert not out.is_empty, "a step with unfinished requests scheduled nothing"
    assert all(s.num_new_tokens >= 1 for s in out.scheduled)
    assert sum(s.num_new_tokens for s in out.scheduled) <= sched.max_num_batched_tokens
    assert out.total_num_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert len(out.scheduled) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
    # the victims are the most recently admitted running requests, latest first
    k = len(out.preempted_ids)
    assert out.preempted_ids == tuple(reversed(running[len(running) - k :]))
    continuing = [s for s in out.scheduled if s.new_token_ids is None]
    admitted = [s for s in out.scheduled if s.new_token_ids is not None]
    # running first (in admission order), then FCFS admission; nobody admitted after a preemption
    assert list(out.scheduled) == continuing + admitted
    assert [s.request_id for s in continuing] == running[: len(continuing)]
    assert [s.request_id for s in admitted] == waiting[: len(admitted)]
    if k:
        assert not admitted
        # the victims wait at the head of the queue, in their admission order
        assert [r.request_id for r in sched.waiting][:k] == running[len(running) - k :]
    # each request gets min(what it lacks, what is left of the budget): exact chunk boundaries
    left = sched.max_num_batched_tokens
    for s in out.scheduled:
        want = num_tokens[s.request_id] - s.num_computed_tokens
        if sched.enable_chunked_prefill or s.new_token_ids is None:
            assert s.num_new_tokens == min(want, left), s
        left -= s.num_new_tokens
    # block accounting: ref counts are exactly the number of tables holding a block
    holders: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.block_id in kv.pool.free_queue) == (block.ref_cnt == 0)
    if not kv.enable_caching:
        assert sum(holders.values()) == len(holders)  # nothing shared
    assert set(kv.req_blocks) == {r.request_id for r in sched.running}


def run(
    sched: Scheduler,
    requests: Sequence[Request],
    runner: FakeRunner | None = None,
    max_steps: int = 10_000,
) -> list[SchedulerOutput]:
    """Add the requests and step until all finish, checking every step; returns the steps."""
    runner = runner or FakeRunner(sched)
    for r in requests:
        sched.add_request(r)
    steps = []
    preemptions = 0
    while sched.has_unfinished():
        assert len(steps) < max_steps, "no progress"
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        num_tokens = {rid: r.num_tokens for rid, r in sched.requests.items()}
        out = sched.schedule(now=float(len(steps)))
        check_step(sched, out, running, waiting, num_tokens)
        preemptions += len(out.preempted_ids)
        sched.update_from_output(out, runner.execute(out), now=float(len(steps)))
        steps.append(out)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks  # every block free after the run
    assert preemptions == sum(r.num_preemptions for r in requests)
    return steps


# ---- exact scenarios ----------------------------------------------------------------------


def test_scheduler_and_kv_cache_import_without_torch() -> None:
    code = "import sys, cbgen.engine.scheduler, cbgen.engine.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_exact_boundaries_and_block_ids() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 20, max_tokens=2)
    steps = run(sched, [a])
    assert [rows(s) for s in steps] == [
        [Row("a", 0, 8, (0, 1), False, True)],
        [Row("a", 8, 8, (2, 3), False, False)],
        [Row("a", 16, 4, (4,), True, False)],
        [Row("a", 20, 1, (5,), True, False)],  # token 21 opens block 5
    ]
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        (8, 0),
        (8, 0),
        (4, 0),
        (0, 1),
    ]
    assert a.output_token_ids == [default_token("a", 0), default_token("a", 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_running_first_then_fcfs_admission_share_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    reqs = [make_request("a", 6, 3), make_request("b", 6, 3), make_request("c", 3, 4)]
    steps = run(sched, reqs)
    assert [rows(s) for s in steps] == [
        # a whole; b gets the 4 tokens left; c waits (no budget)
        [Row("a", 0, 6, (0, 1), True, True), Row("b", 0, 4, (2,), False, True)],
        # running first: a decodes, b finishes its prompt; c admitted from the 7 left
        [
            Row("a", 6, 1, (), True, False),
            Row("b", 4, 2, (3,), True, False),
            Row("c", 0, 3, (4,), True, True),
        ],
        [
            Row("a", 7, 1, (), True, False),
            Row("b", 6, 1, (), True, False),
            Row("c", 3, 1, (), True, False),
        ],
        [Row("b", 7, 1, (), True, False), Row("c", 4, 1, (5,), True, False)],  # a finished
        [Row("c", 5, 1, (), True, False)],
    ]
    assert steps[4].finished_ids == ("b",)
    assert steps[3].finished_ids == ("a",)


def test_slots_limit_admission() -> None:
    sched = make_scheduler(max_num_seqs=2)
    steps = run(sched, [make_request("a", 2, 2), make_request("b", 2, 2), make_request("c", 2, 1)])
    assert [[r.rid for r in rows(s)] for s in steps] == [["a", "b"], ["a", "b"], ["c"]]


def test_preemption_victim_is_last_admitted_and_no_admission_that_step() -> None:
    # 6 blocks of 4 tokens: a (8), b (8) and c (7) fill them; a's first decode needs a 7th
    sched = make_scheduler(num_blocks=6)
    a, b, c, d = (
        make_request("a", 8),
        make_request("b", 8),
        make_request("c", 7),
        make_request("d", 1),
    )
    for r in (a, b, c, d):
        sched.add_request(r)
    runner = FakeRunner(sched)

    def step() -> SchedulerOutput:
        out = sched.schedule(0.0)
        sched.update_from_output(out, runner.execute(out), 0.0)
        return out

    s0 = step()
    assert rows(s0) == [
        Row("a", 0, 8, (0, 1), True, True),
        Row("b", 0, 8, (2, 3), True, True),
        Row("c", 0, 7, (4, 5), True, True),
    ]
    assert [r.request_id for r in sched.waiting] == ["d"]  # no blocks left for d
    s1 = step()
    # a needs a block: c (admitted last) is preempted; its blocks are freed tail first
    # (free queue [5, 4]) and a takes 5, b takes 4; d is not admitted in this step
    assert s1.preempted_ids == ("c",)
    assert rows(s1) == [Row("a", 8, 1, (5,), True, False), Row("b", 8, 1, (4,), True, False)]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [default_token("c", 0)]  # kept: it is recomputed, not redrawn
    s2 = step()
    assert rows(s2) == [Row("a", 9, 1, (), True, False), Row("b", 9, 1, (), True, False)]
    s3 = step()  # a and b finish (4 tokens); they free [5, 1, 0] then [4, 3, 2]
    assert [r.rid for r in rows(s3)] == ["a", "b"] and not sched.running
    assert list(sched.kv.pool.free_queue) == [5, 1, 0, 4, 3, 2]
    s4 = step()
    # c recomputes prompt + its 1 output token as a prefill and samples its 2nd token
    assert rows(s4) == [Row("c", 0, 8, (5, 1), True, True), Row("d", 0, 1, (0,), True, True)]
    assert s4.scheduled[0].new_token_ids == (*c.prompt_token_ids, default_token("c", 0))
    assert c.output_token_ids[:2] == [default_token("c", 0), default_token("c", 1)]
    while sched.has_unfinished():
        step()
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, d.num_preemptions) == (
        0,
        0,
        1,
        0,
    )
    assert sched.kv.num_free_blocks == 6


def test_the_request_that_needs_a_block_is_its_own_victim_when_last() -> None:
    # a (6 tokens) has room in its 2nd block; b (8) fills 2 blocks, and its decode needs a 3rd
    sched = make_scheduler(num_blocks=4)
    steps = run(sched, [make_request("a", 6, 2), make_request("b", 8, 2)])
    assert rows(steps[1]) == [Row("a", 6, 1, (), True, False)]
    assert steps[1].preempted_ids == ("b",)
    # b freed its blocks (tail first) during step 1's scheduling, a freed its own after the
    # step: the free queue is [3, 2, 1, 0] and b comes back with prompt + 1 token
    assert rows(steps[2]) == [Row("b", 0, 9, (3, 2, 1), True, True)]


def test_without_chunked_prefill_a_prompt_is_admitted_whole() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    steps = run(sched, [make_request("a", 6, 2), make_request("b", 6, 2)])
    assert [rows(s) for s in steps] == [
        [Row("a", 0, 6, (0, 1), True, True)],  # 2 tokens left: b waits rather than split
        [Row("a", 6, 1, (), True, False), Row("b", 0, 6, (2, 3), True, True)],
        [Row("b", 6, 1, (), True, False)],
    ]


def test_without_chunked_prefill_a_recompute_longer_than_the_budget_is_chunked() -> None:
    # b is preempted holding 9 tokens (> the budget of 8): it could never be recomputed whole
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8, chunked=False)
    a, b = make_request("a", 4, 8), make_request("b", 7, 8)
    steps = run(sched, [a, b])
    assert steps[3].preempted_ids == ("b",)
    # step 4: a decodes (1 token), b comes back with the 7 tokens left of the budget (into its
    # own freed blocks 3, 2); step 5: a needs a 3rd block and b, last admitted, goes again;
    # step 8: a has finished and b recomputes 8 of its 9 tokens, then the 9th and samples
    readmissions = [
        (i, s)
        for i, step in enumerate(steps)
        for s in step.scheduled
        if s.new_token_ids is not None
    ]
    assert [
        (i, s.request_id, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids)
        for i, s in readmissions[2:]
    ] == [
        (4, "b", 0, 7, (3, 2)),
        (8, "b", 0, 8, (3, 2)),
    ]
    assert steps[5].preempted_ids == ("b",) and b.num_preemptions == 2
    assert rows(steps[9]) == [Row("b", 8, 1, (1,), True, False)]
    assert len(b.output_token_ids) == 8 and len(a.output_token_ids) == 8


def test_shared_prefix_is_taken_from_the_cache_with_exact_block_ids() -> None:
    sched = make_scheduler(num_blocks=16, caching=True)
    runner = FakeRunner(sched)
    p = list(range(40, 50))  # 10 tokens: 2 full blocks + 2
    a, twin = make_request("a", p, 1), make_request("twin", p, 1)
    steps = run(sched, [a, twin], runner)
    # admitted in the same step: a's full blocks are cached as soon as they are scheduled, so
    # twin shares them at once and computes only its last partial block
    assert rows(steps[0]) == [
        Row("a", 0, 10, (0, 1, 2), True, True),
        Row("twin", 8, 2, (0, 1, 3), True, True),
    ]
    assert steps[0].num_cached_tokens == 8
    # blocks 4.. were never used, so they head the free queue; 0 and 1 stay cached
    b = make_request("b", [*p[:8], 7, 7], 2)
    steps = run(sched, [b], runner)
    assert rows(steps[0]) == [Row("b", 8, 2, (0, 1, 4), True, True)]
    assert steps[0].num_cached_tokens == 8 and b.num_cached_tokens == 8
    assert runner.num_context_reads >= 8  # b attended to a's K/V, checked slot by slot


def test_a_prefix_ending_inside_a_block_is_copied_down_to_the_token() -> None:
    sched = make_scheduler(num_blocks=16, caching=True)
    runner = FakeRunner(sched)
    p = list(range(40, 52))  # 12 tokens: 3 full blocks
    a = make_request("a", p, 1)
    assert rows(run(sched, [a], runner)[0]) == [Row("a", 0, 12, (0, 1, 2), True, True)]
    # b shares a's first block and 2 tokens of its second: block 0 is a hit, the 2 tokens' K/V
    # are copied from a's block 1 into b's own next block (3, the free queue's head)
    b = make_request("b", [*p[:6], 7, 7, 7], 1)
    reads = runner.num_context_reads
    (step,) = run(sched, [b], runner)
    assert rows(step) == [Row("b", 6, 3, (0, 3, 4), True, True)]
    assert step.scheduled[0].kv_copy == (1, 3, 2)
    assert step.num_cached_tokens == 6 and b.num_cached_tokens == 6
    assert runner.num_context_reads - reads == 6  # checked slot by slot, copies included
    # admitted in the same step as c, d shares c's first block (cached when scheduled) but no
    # partial hit from c's second: its K/V is not written before this step runs
    c, d = (
        make_request("c", [90, 91, 92, 93, 94, 95, 96, 97], 1),
        make_request("d", [90, 91, 92, 93, 94, 95, 9], 1),
    )
    step = run(sched, [c, d], runner)[0]
    assert [(s.num_computed_tokens, s.kv_copy) for s in step.scheduled] == [(0, None), (4, None)]


def test_a_preempted_request_gets_its_own_cached_blocks_back() -> None:
    sched = make_scheduler(num_blocks=6, caching=True)
    runner = FakeRunner(sched)
    a, b, c = make_request("a", 8, 2), make_request("b", 7, 2), make_request("c", 7, 2)
    steps = run(sched, [a, b, c], runner)
    assert rows(steps[0]) == [
        Row("a", 0, 8, (0, 1), True, True),
        Row("b", 0, 7, (2, 3), True, True),
        Row("c", 0, 7, (4, 5), True, True),
    ]
    # a's decode needs a 3rd block: c goes, freeing its partial block 5 and then its full,
    # cached block 4; a takes 5, and a and b finish
    assert steps[1].preempted_ids == ("c",)
    assert rows(steps[1]) == [Row("a", 8, 1, (5,), True, False), Row("b", 7, 1, (), True, False)]
    # c (7 prompt + 1 output tokens) comes back to its own block 4: 4 tokens not recomputed
    assert rows(steps[2]) == [Row("c", 4, 4, (4, 5), True, True)]
    assert steps[2].num_cached_tokens == 4
    assert c.num_cached_tokens == 0  # counted at first admission only
    assert c.num_preemptions == 1


def test_abort_frees_blocks_and_leaves_the_queues() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(0.0)
    assert [s.request_id for s in out.scheduled] == ["a"]
    sched.finish([a, b], 1.0, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 64
    assert (a.status, b.status, a.finished_time) == (RequestStatus.FINISHED_ABORTED,) * 2 + (1.0,)
    assert sched.schedule(2.0).finished_ids == ("a", "b")


# ---- property-based -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
# without chunked prefill, a request preempted holding more tokens than the budget
@example(
    (
        {
            "num_blocks": 4,
            "max_num_seqs": 2,
            "max_num_batched_tokens": 8,
            "block_size": 4,
            "chunked": False,
            "caching": False,
        },
        [(4, 8, 0), (7, 8, 1)],
    )
)
def test_random_workloads_keep_every_invariant(
    work: tuple[dict[str, object], list[tuple[int, int, int]]],
) -> None:
    cfg, specs = work
    sched = make_scheduler(**cfg)  # type: ignore[arg-type]
    prefixes = [[900 + 3 * j + i % 3 for i in range(24)] for j in range(3)]
    reqs = []
    for i, (plen, max_tokens, group) in enumerate(specs):
        if group == 3:
            prompt = list(range(500, 500 + plen))
        else:
            prompt = [*(prefixes[group] + [i] * 40)[: plen - 1], 10000 + i]
        reqs.append(make_request(f"r{i}", prompt, max_tokens))
    run(sched, reqs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [
            default_token(r.request_id, j) for j in range(r.sampling_params.max_tokens)
        ]
