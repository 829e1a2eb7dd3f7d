"""The scheduler tests' fake model: requests and schedulers made small, a fake runner that
plays the runner's side of the SchedulerOutput contract, and random workloads for property tests.

The fake runner rebuilds every request's tokens and block table from what the scheduler sends,
simulates the KV cache as a map slot -> "the prefix this slot's K/V was computed from", checks
every context slot a request attends to, and returns a chosen token for each request that samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import strategies as st

from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.request import Request
from cbgen.engine.scheduler import Scheduler, SchedulerOutput
from cbgen.sampling_params import SamplingParams

BS = 4  # the block size of the scheduler tests unless stated


def make_request(
    rid: str,
    prompt: int | Sequence[int],
    max_tokens: int = 4,
    *,
    min_tokens: int = 0,
    eos_token_id: int | None = None,
    ignore_eos: bool = True,
    stop_token_ids: Sequence[int] = (),
) -> Request:
    """A request; an int prompt means that many tokens, distinct from every other request's."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 997 + 1)
        prompt = list(range(base, base + prompt))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids),
        temperature=0.0,
    )
    return Request(rid, list(prompt), params, arrival_time=0.0, eos_token_id=eos_token_id)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    *,
    block_size: int = BS,
    chunked: bool = True,
    caching: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill=chunked)


def default_token(rid: str, index: int) -> int:
    """The fake model's choice for output token `index` of request `rid`."""
    return 7 + (sum(map(ord, rid)) * 31 + index * 17) % 50


def prefix_ids(tokens: Sequence[int]) -> list[int]:
    """One id per position standing for the whole prefix up to it: what its K/V depends on."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class FakeRunner:
    def __init__(self, sched: Scheduler, choose: Callable[[str, int], int] = default_token) -> None:
        self.sched = sched
        self.bs = sched.kv.block_size
        self.choose = choose
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[int, int] = {}
        """slot -> prefix id of the token whose K/V it holds"""
        self.num_context_reads = 0

    def slot(self, rid: str, pos: int) -> int:
        return self.tables[rid][pos // self.bs] * self.bs + pos % self.bs

    def begin(self, out: SchedulerOutput) -> None:
        """Forget what finished or was preempted; copy partial prefix hits' K/V (before the
        step runs, as the engine does)."""
        for rid in (*out.finished_ids, *out.preempted_ids):
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        for s in out.scheduled:
            if s.kv_copy is not None:
                src, dst, n = s.kv_copy
                for k in range(n):
                    self.slots[dst * self.bs + k] = self.slots[src * self.bs + k]

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self.begin(out)
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            rid = s.request_id
            if s.new_token_ids is not None:  # (re)admitted: the full token list, a fresh table
                self.tokens[rid] = list(s.new_token_ids)
                self.tables[rid] = []
            tokens = self.tokens[rid]
            self.tables[rid].extend(s.new_block_ids)
            assert self.tables[rid] == self.sched.kv.block_ids(rid)
            end = s.num_computed_tokens + s.num_new_tokens
            assert len(self.tables[rid]) == -(-end // self.bs)
            prefix = prefix_ids(tokens[:end])
            for pos in range(s.num_computed_tokens):  # attention reads the cached context
                assert self.slots.get(self.slot(rid, pos)) == prefix[pos], (rid, pos)
                self.num_context_reads += 1
            for pos in range(s.num_computed_tokens, end):  # and writes the new tokens' K/V
                self.slots[self.slot(rid, pos)] = prefix[pos]
            assert s.will_sample == (end == len(tokens))
            if s.will_sample:
                token = self.choose(rid, len(tokens) - self.sched.requests[rid].num_prompt_tokens)
                tokens.append(token)
                sampled[rid] = token
        return sampled


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, object], list[tuple[int, int, int]]]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    specs = draw(
        st.lists(
            st.tuples(
                st.integers(1, 40),  # prompt length
                st.integers(1, 12),  # max_tokens
                st.integers(0, 3),  # 0-2: one of 3 shared prefixes, then a unique last token;
                # 3: the first 40 tokens of one fixed sequence (whole prompts repeat)
            ),
            min_size=2,
            max_size=10,
        )
    )
    longest = max(p + m for p, m, _ in specs)
    need = -(-longest // block_size)  # one request must always fit alone (the engine checks it)
    cfg = dict(
        num_blocks=draw(st.integers(need, need + 4)),  # tight: preemptions are common
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        block_size=block_size,
        chunked=draw(st.booleans()),
        caching=draw(st.booleans()),
    )
    if not cfg["chunked"]:  # the engine rejects prompts longer than one step's budget
        cfg["max_num_batched_tokens"] = max(p for p, _, _ in specs) + draw(st.integers(0, 4))
    return cfg, specs
