"""Drive one Engine through a workload, requests arriving at their arrival times, and record
what happened: one RequestRecord per request, one StepRecord per engine step.

    start                                                          end (last request done)
      |-- a0 --- a1 ------- a2 -- ...                                 |
      |  step | step | step | (idle until the next arrival) | step ...|
    wall_s = end - start; every time below is seconds since start (one clock, perf_counter)

A request that arrives while a step runs is added right after that step, but keeps its
arrival time: the time it waited for the step is queue time, as it would be in a server.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import psutil

from cbgen.bench.workloads import BenchRequest
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import RequestOutput, StepStats
from cbgen.engine.request import Request
from cbgen.engine.static_scheduler import PaddingStats
from cbgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    prompt_tokens: int
    output_len: int
    """Tokens asked for."""
    output_tokens: int
    """Tokens generated (equal to output_len unless the request failed)."""
    cached_tokens: int
    num_preemptions: int
    finish_reason: str
    error: str | None
    arrival_s: float
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    e2e_s: float | None
    itls_s: tuple[float, ...] = ()
    """Every inter-token latency of this request (pooled for the ITL percentiles)."""


@dataclass(frozen=True)
class StepRecord:
    t_s: float
    """When the step ended, since start."""
    duration_s: float
    num_running: int
    num_scheduled: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int
    num_preempted: int


@dataclass
class RunResult:
    label: str
    policy: str
    slots: int
    """Slot capacity: max_num_seqs, or the batch size of the static policy."""
    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_s: float
    warmup_s: float
    num_preemptions: int
    padding: PaddingStats | None
    """Counted by the static scheduler; None under the continuous policy (nothing padded)."""
    other_load: float = float("nan")
    """Cores kept busy by other processes during the timed run (see cpu_busy_s)."""
    overrides: dict[str, object] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """Figures a step hook adds to the summary (cbgen.bench.probes: profile, alternation)."""


class StepHook(Protocol):
    """Called around every step of a timed run (index: the step's, from 0), and once at its
    end, also when the run fails: a profiler's window, a path switched on and off."""

    def before_step(self, index: int) -> None: ...

    def after_step(self, index: int, stats: StepStats) -> None: ...

    def finish(self) -> None: ...


Params = Callable[[BenchRequest, int, int], SamplingParams]
"""(request, its index in the workload, seed) -> its sampling parameters."""


def bench_params(request: BenchRequest, index: int, seed: int) -> SamplingParams:
    """Exactly output_len tokens whatever the model says; seeded sampling at temperature 1
    (the usual throughput-benchmark setting), so that a run can be repeated."""
    return SamplingParams(
        max_tokens=request.output_len,
        ignore_eos=True,
        temperature=1.0,
        seed=seed * 1_000_003 + index,
    )


def warm_up(engine: Engine, num_requests: int, seed: int) -> float:
    """Run a few short random requests (prefill and decode) before timing; then drop what
    they left in the prefix cache. Returns the seconds it took."""
    if num_requests <= 0:
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed + 7919)
    vocab = engine.model_config.vocab_size
    room = min(engine.max_model_len, engine.num_blocks * engine.config.block_size)
    prompt_len = max(1, min(128, room // 2))
    new_tokens = max(1, min(16, room - prompt_len))
    for i in range(num_requests):
        ids = [int(t) for t in rng.integers(0, vocab, size=prompt_len)]
        try:
            engine.add_request(
                f"warmup-{i}", ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=i)
            )
        except ValueError:
            break  # a KV cache too small for this warm-up request: warm up with fewer
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return time.perf_counter() - t0


def cpu_busy_s() -> tuple[float, float]:
    """(CPU-seconds all cores have been busy, CPU-seconds this process and its children have
    used), since boot: their growth over a window, divided by its length, is the number of
    cores other processes kept busy. On a shared machine that says how much a run was
    disturbed: 0 means it had the machine to itself."""
    t = psutil.cpu_times()
    busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
    me = psutil.Process().cpu_times()
    return busy, me.user + me.system + me.children_user + me.children_system


def run_workload(
    engine: Engine,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    *,
    label: str,
    seed: int = 0,
    num_warmup: int = 4,
    progress: Callable[[int, int, int, float], None] | None = None,
    progress_every_s: float = 15.0,
    params: Params = bench_params,
    hooks: Sequence[StepHook] = (),
) -> RunResult:
    """Run every request through the engine, each added at start + its arrival offset.
    progress(done, total, output tokens so far, seconds since start) is called every
    progress_every_s seconds while it runs; hooks around every timed step."""
    if len(arrivals) != len(requests):
        raise ValueError(f"arrivals: {len(arrivals)} given for {len(requests)} requests")
    warmup_s = warm_up(engine, num_warmup, seed)
    padding_before = engine.padding_stats
    preemptions_before = engine.total_preemptions

    order = deque(sorted(range(len(requests)), key=lambda i: arrivals[i]))
    live: dict[str, tuple[Request, float]] = {}
    records: dict[str, RequestRecord] = {}
    steps: list[StepRecord] = []
    busy0, own0 = cpu_busy_s()
    start = time.perf_counter()
    next_report = start + progress_every_s
    tokens_done = 0
    try:
        while order or engine.has_unfinished_requests():
            now = time.perf_counter()
            while order and start + arrivals[order[0]] <= now:
                i = order.popleft()
                r = requests[i]
                arrival = start + arrivals[i]
                try:
                    req = engine.add_request(
                        r.request_id, r.prompt_token_ids, params(r, i, seed), arrival
                    )
                except ValueError as e:
                    records[r.request_id] = _error_record(r, arrivals[i], str(e))
                    continue
                live[r.request_id] = (req, arrivals[i])
            if not engine.has_unfinished_requests():
                if order:
                    time.sleep(max(0.0, start + arrivals[order[0]] - time.perf_counter()))
                continue
            for hook in hooks:
                hook.before_step(len(steps))
            out = engine.step()
            st = out.stats
            for hook in hooks:
                hook.after_step(len(steps), st)
            steps.append(
                StepRecord(
                    t_s=st.time - start,
                    duration_s=st.duration_s,
                    num_running=st.num_running,
                    num_scheduled=st.num_scheduled,
                    num_waiting=st.num_waiting,
                    num_kv_blocks_used=st.num_kv_blocks_used,
                    num_kv_blocks_total=st.num_kv_blocks_total,
                    num_prefill_tokens=st.num_prefill_tokens,
                    num_decode_tokens=st.num_decode_tokens,
                    num_cached_tokens=st.num_cached_tokens,
                    num_preempted=st.num_preempted,
                )
            )
            for o in out.finished:
                req, arrival_s = live.pop(o.request_id)
                records[o.request_id] = _record(o, req, arrival_s)
                tokens_done += o.num_output_tokens
            if progress is not None and st.time >= next_report:
                progress(len(records), len(requests), tokens_done, st.time - start)
                next_report = st.time + progress_every_s
        wall_s = time.perf_counter() - start
    finally:  # a hook that switched a path puts it back, even after a failure
        for hook in hooks:
            hook.finish()
    busy1, own1 = cpu_busy_s()
    other_load = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall_s if wall_s > 0 else float("nan")
    padding = engine.padding_stats
    if padding is not None and padding_before is not None:
        padding = padding.since(padding_before)
    return RunResult(
        label=label,
        policy=engine.config.scheduling_policy,
        slots=engine.num_slots,
        requests=[records[r.request_id] for r in requests],
        steps=steps,
        wall_s=wall_s,
        warmup_s=warmup_s,
        num_preemptions=engine.total_preemptions - preemptions_before,
        padding=padding,
        other_load=other_load,
    )


def _record(o: RequestOutput, req: Request, arrival_s: float) -> RequestRecord:
    m = o.metrics
    times = req.token_times
    return RequestRecord(
        request_id=o.request_id,
        prompt_tokens=o.num_prompt_tokens,
        output_len=req.sampling_params.max_tokens,
        output_tokens=o.num_output_tokens,
        cached_tokens=o.num_cached_tokens,
        num_preemptions=o.num_preemptions,
        finish_reason=o.finish_reason,
        error=o.error,
        arrival_s=arrival_s,
        queue_s=m.queue_s,
        ttft_s=m.ttft_s,
        tpot_s=m.tpot_s,
        itl_p50_s=m.itl_p50_s,
        itl_p99_s=m.itl_p99_s,
        itl_max_s=m.itl_max_s,
        e2e_s=m.e2e_s,
        itls_s=tuple(b - a for a, b in itertools.pairwise(times)),
    )


def _error_record(r: BenchRequest, arrival_s: float, message: str) -> RequestRecord:
    return RequestRecord(
        request_id=r.request_id,
        prompt_tokens=r.prompt_len,
        output_len=r.output_len,
        output_tokens=0,
        cached_tokens=0,
        num_preemptions=0,
        finish_reason="error",
        error=message,
        arrival_s=arrival_s,
        queue_s=None,
        ttft_s=None,
        tpot_s=None,
        itl_p50_s=None,
        itl_p99_s=None,
        itl_max_s=None,
        e2e_s=None,
    )
