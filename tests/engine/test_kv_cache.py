"""BlockPool / KVCacheManager, exactly: block ids, reference counts and the free queue after
each allocate and free; the prefix cache's hash chains, last-token cap, eviction order and
collision safety. No model, no torch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from cbgen.engine import kv_cache
from cbgen.engine.block_pool import hash_block
from cbgen.engine.kv_cache import KVCacheManager
from cbgen.engine.request import Request
from cbgen.sampling_params import SamplingParams


def make_request(rid: str, prompt: Sequence[int]) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), arrival_time=0.0)


def computed(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the scheduler does after a forward pass wrote n more tokens of req."""
    req.num_computed_tokens += n
    kv.cache_blocks(req, req.num_computed_tokens)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does to admit req: take its cached prefix, then room for the rest."""
    hits, num_cached = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_cached if num_new is None else num_new
    ids = kv.allocate_slots(req, num_new, hits)
    if ids is not None:
        req.num_computed_tokens = num_cached
    return ids


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


# ---- allocation without caching ----------------------------------------------------------


def test_allocate_and_free_exact_ids_ref_counts_and_free_queue() -> None:
    kv = KVCacheManager(8, 4, enable_caching=False)
    a, b = make_request("a", range(6)), make_request("b", range(100, 109))
    assert kv.allocate_slots(a, 6) == [0, 1]
    assert kv.allocate_slots(b, 9) == [2, 3, 4]
    assert refs(kv) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert free_queue(kv) == [5, 6, 7]
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 1) == []  # token 7 still fits in block 1
    a.num_computed_tokens = 7
    assert kv.allocate_slots(a, 2) == [5]  # tokens 8 and 9: block 2 of a's table
    assert kv.block_ids("a") == [0, 1, 5] and kv.block_ids("b") == [2, 3, 4]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (6, 2)
    kv.free(a)  # tail first to the back of the queue: a prefix outlives its tail
    assert free_queue(kv) == [6, 7, 5, 1, 0]
    assert refs(kv) == [0, 0, 1, 1, 1, 0, 0, 0]
    kv.free(b)
    assert free_queue(kv) == [6, 7, 5, 1, 0, 4, 3, 2]
    c = make_request("c", range(12))
    assert kv.allocate_slots(c, 12) == [6, 7, 5]  # from the front
    assert free_queue(kv) == [1, 0, 4, 3, 2]
    assert kv.block_ids("a") == [] and "a" not in kv.req_blocks
    assert kv.pool.cached == {} and all(blk.block_hash is None for blk in kv.pool.blocks)
    assert (kv.num_queries, kv.num_hits) == (6 + 9 + 12, 0)  # counted once per admission


def test_no_room_is_none_and_changes_nothing() -> None:
    kv = KVCacheManager(4, 4, enable_caching=False)
    a, b = make_request("a", range(12)), make_request("b", range(8))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.req_blocks and free_queue(kv) == [3] and refs(kv) == [1, 1, 1, 0]
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 5) is None  # 17 tokens need 5 blocks, a holds 3, 1 is free
    assert kv.block_ids("a") == [0, 1, 2] and free_queue(kv) == [3]
    assert kv.allocate_slots(a, 4) == [3]


def test_caching_off_never_hits() -> None:
    kv = KVCacheManager(8, 2, enable_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == [0, 1, 2]
    computed(kv, a, 5)
    kv.free(a)
    again = make_request("again", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(again) == ([], 0)
    assert kv.pool.cached == {}


# ---- hashes ---------------------------------------------------------------------------------


def test_hash_block_is_a_sha256_chain_over_int64_token_ids() -> None:
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hashlib.sha256(b"\0" + np.array([1, 2, 3, 4], dtype=np.int64).tobytes()).digest()
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h1 == hashlib.sha256(h0 + np.array([5, 6, 7, 8], dtype="<i8").tobytes()).digest()
    assert len({h0, h1, hash_block(None, [5, 6, 7, 8]), hash_block(None, [2, 1, 3, 4])}) == 4


def test_hash_block_is_stable_across_processes() -> None:
    """Not Python's hash(): the same digest under another PYTHONHASHSEED."""
    code = (
        "from cbgen.engine.block_pool import hash_block as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()


def test_full_blocks_are_registered_with_their_hash_chain() -> None:
    kv = KVCacheManager(8, 4)
    tokens = list(range(50, 60))  # 10 tokens: blocks 0 and 1 full, block 2 partial
    a = make_request("a", tokens)
    assert admit(kv, a, 6) == [0, 1]
    computed(kv, a, 6)  # block 0 full, block 1 half written
    h0 = hash_block(None, tokens[0:4])
    assert kv.pool.cached == {h0: 0}
    assert kv.allocate_slots(a, 4) == [2]
    computed(kv, a, 4)
    h1 = hash_block(h0, tokens[4:8])
    assert kv.pool.cached == {h0: 0, h1: 1}
    b0, b1, b2 = kv.pool.blocks[:3]
    assert (b0.block_hash, b0.parent_hash, b0.token_ids) == (h0, None, tuple(tokens[0:4]))
    assert (b1.block_hash, b1.parent_hash, b1.token_ids) == (h1, h0, tuple(tokens[4:8]))
    assert b2.block_hash is None  # partial: never cached
    # two decodes fill block 2 (the 2nd token's K/V is written the step after it is sampled)
    a.append_output_token(77, 0.0)
    a.append_output_token(78, 0.0)
    computed(kv, a, 1)
    assert b2.block_hash is None
    computed(kv, a, 1)
    assert b2.block_hash == hash_block(h1, [*tokens[8:10], 77, 78])


# ---- sharing, the last-token cap, hit accounting ---------------------------------------


def test_shared_prefix_ref_counts_and_the_last_token_cap() -> None:
    kv = KVCacheManager(8, 4)
    p = list(range(10, 19))  # 9 tokens: 2 full blocks + 1
    a = make_request("a", p)
    assert admit(kv, a) == [0, 1, 2]
    computed(kv, a, 9)
    blk0, blk1 = kv.pool.blocks[0], kv.pool.blocks[1]
    # same 8-token prefix, another last token: both full blocks are hits
    b = make_request("b", [*p[:8], 99])
    assert kv.get_computed_blocks(b) == ([blk0, blk1], 8)
    assert admit(kv, b) == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert refs(kv) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert free_queue(kv) == [4, 5, 6, 7]
    # a prompt that is exactly the 2 cached blocks still computes its last token: 1 hit only
    c = make_request("c", p[:8])
    assert kv.get_computed_blocks(c) == ([blk0], 4)
    assert admit(kv, c) == [0, 4]
    assert refs(kv)[:5] == [3, 2, 1, 1, 1]
    # a 4-token prompt: no hit at all (its only block holds its last token)
    assert kv.get_computed_blocks(make_request("d", p[:4])) == ([], 0)
    assert kv.get_computed_blocks(make_request("e", p[:5])) == ([blk0], 4)
    # freeing drops references; a block joins the free queue only at 0
    kv.free(a)
    assert refs(kv)[:5] == [2, 1, 0, 1, 1] and free_queue(kv) == [5, 6, 7, 2]
    kv.free(b)
    kv.free(c)
    assert refs(kv) == [0] * 8
    # b's tail 3 and block 1 (b held it last), then c's tail 4 and block 0
    assert free_queue(kv) == [5, 6, 7, 2, 3, 1, 4, 0]
    # hit accounting: tokens asked for and tokens served, once per admission
    assert (kv.num_queries, kv.num_hits) == (9 + 9 + 8, 0 + 8 + 4)
    assert kv.hit_rate == pytest.approx(12 / 26)


def test_idle_hits_are_not_counted_as_free_room() -> None:
    kv = KVCacheManager(3, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(kv, a) == [0, 1, 2]
    computed(kv, a, 5)
    kv.free(a)
    assert free_queue(kv) == [2, 1, 0]
    # hits 0 and 1 sit in the free queue; b needs 2 more blocks but only block 2 is really free
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9])
    assert admit(kv, b) is None
    assert free_queue(kv) == [2, 1, 0] and refs(kv) == [0, 0, 0] and "b" not in kv.req_blocks
    assert (kv.num_queries, kv.num_hits) == (5, 0)  # a failed admission is not counted
    c = make_request("c", [1, 2, 3, 4, 7])
    assert admit(kv, c) == [0, 1, 2]
    assert refs(kv) == [1, 1, 1] and free_queue(kv) == []
    assert (kv.num_queries, kv.num_hits) == (10, 4)


# ---- eviction order ---------------------------------------------------------------------


def test_eviction_is_lru_with_tails_before_prefixes() -> None:
    kv = KVCacheManager(8, 2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0 1 2 full, 3 partial
    b = make_request("b", [11, 12, 13, 14, 15])  # blocks 4 5 full, 6 partial
    assert admit(kv, a) == [0, 1, 2, 3]
    assert admit(kv, b) == [4, 5, 6]
    computed(kv, a, 7)
    computed(kv, b, 5)
    kv.free(a)  # a first: least recently used
    kv.free(b)
    assert free_queue(kv) == [7, 3, 2, 1, 0, 6, 5, 4]
    assert sorted(kv.pool.cached.values()) == [0, 1, 2, 4, 5]
    # new blocks come from the front: the never-used 7, a's partial 3, then a's tail 2
    c = make_request("c", [21, 22, 23, 24, 25, 26])
    assert admit(kv, c) == [7, 3, 2]
    assert sorted(kv.pool.cached.values()) == [0, 1, 4, 5]  # block 2 evicted
    assert kv.pool.num_evictions == 1
    # a's prefix (blocks 0, 1) survived, its tail did not
    again = make_request("a2", [1, 2, 3, 4, 5, 6, 7])
    hits, n = kv.get_computed_blocks(again)
    assert ([blk.block_id for blk in hits], n) == ([0, 1], 4)
    # a hit moves a block out of the queue; freed again, it is the most recently used
    assert admit(kv, again) == [0, 1, 6, 5]  # b's tail 6 and then 5 are evicted
    assert sorted(kv.pool.cached.values()) == [0, 1, 4]
    kv.free(again)
    assert free_queue(kv) == [4, 5, 6, 1, 0]
    assert kv.pool.num_evictions == 2


# ---- collisions ------------------------------------------------------------------------


def test_equal_hash_of_different_tokens_is_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "hash_block", lambda parent, tokens: b"same")
    kv = KVCacheManager(8, 4)
    a = make_request("a", [1, 2, 3, 4, 9])
    admit(kv, a)
    computed(kv, a, 5)
    assert kv.pool.cached == {b"same": 0}
    b = make_request("b", [5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [2, 3]
    computed(kv, b, 5)
    assert kv.pool.cached == {b"same": 0}  # b's block stays private
    assert kv.pool.blocks[2].block_hash is None
    assert refs(kv)[:4] == [1, 1, 1, 1]


def test_equal_hash_of_equal_tokens_after_another_prefix_is_not_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hash that forgets the parent: block [5 6 7 8] after [1 2 3 4] and the same tokens at
    the start of a prompt collide; their K/V differ (other positions, other context)."""

    def tokens_only(parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()

    monkeypatch.setattr(kv_cache, "hash_block", tokens_only)
    kv = KVCacheManager(8, 4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    computed(kv, a, 9)
    assert len(kv.pool.cached) == 2
    b = make_request("b", [5, 6, 7, 8, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([], 0)
    # while the true prefix still hits
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    hits, n = kv.get_computed_blocks(c)
    assert ([blk.block_id for blk in hits], n) == ([0, 1], 8)


# ---- partial hits --------------------------------------------------------------------------


def test_partial_hit_takes_the_first_tokens_of_a_block_written_in_an_earlier_step() -> None:
    kv = KVCacheManager(16, 4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    kv.new_step()
    admit(kv, a)
    computed(kv, a, 10)  # blocks [1..4], [5..8] cached in this step
    b = make_request("b", [1, 2, 3, 4, 5, 6, 70, 80, 90])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.get_partial_block(b, hits) is None  # a's blocks are not written until the step ran
    kv.new_step()
    block, j = kv.get_partial_block(b, hits)
    assert block.block_id == kv.block_ids("a")[1] and j == 2  # [5, 6] of a's [5, 6, 7, 8]
    assert kv.allocate_slots(b, 3, hits, 2) is not None  # 4 cached + 2 copied + 3 new: 3 blocks
    assert len(kv.block_ids("b")) == 3 and kv.block_ids("b")[0] == kv.block_ids("a")[0]
    assert kv.num_hits == 6
    # at most up to the last token: a prompt that is a's first 6 tokens reuses 5 of them
    c = make_request("c", [1, 2, 3, 4, 5, 6])
    hits, _ = kv.get_computed_blocks(c)
    assert kv.get_partial_block(c, hits)[1] == 1
    # none when no cached block starts like the next block (first blocks: after no block)
    d = make_request("d", [9, 9, 9, 9, 5, 6, 7])
    assert kv.get_partial_block(d, kv.get_computed_blocks(d)[0]) is None
    e = make_request("e", [1, 2, 3, 4, 50, 6, 7])
    assert kv.get_partial_block(e, kv.get_computed_blocks(e)[0]) is None


def test_partial_hit_source_gone_once_evicted_and_none_without_caching() -> None:
    kv = KVCacheManager(3, 4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.new_step()
    admit(kv, a)
    computed(kv, a, 9)
    kv.free(a)
    kv.new_step()
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0])
    hits, _ = kv.get_computed_blocks(b)
    assert kv.get_partial_block(b, hits)[1] == 2
    # a request with nothing in common takes every free block: the cached ones are evicted
    other = make_request("x", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49])
    assert admit(kv, other) is not None
    kv.free(other)
    assert kv.get_partial_block(b, kv.get_computed_blocks(b)[0]) is None
    off = KVCacheManager(8, 4, enable_caching=False)
    off.new_step()
    admit(off, a)
    computed(off, a, 9)
    off.new_step()
    assert off.get_partial_block(b, []) is None


def test_many_blocks_registered_in_one_step_keep_the_earlier_partial_sources() -> None:
    """Twenty requests admitted in one step each cache a block after the shared first block;
    the block cached in the step before stays a partial-hit source for the next step."""
    kv = KVCacheManager(64, 4)
    kv.new_step()
    first = make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(kv, first)
    computed(kv, first, 9)
    kv.new_step()
    for i in range(20):
        r = make_request(f"r{i}", [1, 2, 3, 4, 5, 6, 100 + i, 200 + i, 0])
        admit(kv, r)
        computed(kv, r, 9)
    assert (
        len(kv.pool.children[kv.pool.blocks[kv.block_ids("first")[1]].parent_hash])
        == kv.pool.MAX_CHILDREN
    )
    late = make_request("late", [1, 2, 3, 4, 5, 6, 7, 0])  # admitted in the same step
    hits, _ = kv.get_computed_blocks(late)
    block, j = kv.get_partial_block(late, hits)
    assert block.block_id == kv.block_ids("first")[1] and j == 3
    # closer to r19's block (3 tokens) than to first's (2), but r19's is usable only next step
    near = make_request("near", [1, 2, 3, 4, 5, 6, 119, 0, 1])
    hits, _ = kv.get_computed_blocks(near)
    assert kv.get_partial_block(near, hits)[1] == 2
    kv.new_step()
    block, j = kv.get_partial_block(near, hits)
    assert block.block_id == kv.block_ids("r19")[1] and j == 3
