"""KVCacheManager: each request's block table on top of a BlockPool (cbgen.engine.block_pool:
reference counts, the free queue that is also the prefix cache's eviction order, hashed full
blocks checked on every hit, partial hits down to the token).

A request's block table covers its tokens in order; block i holds tokens
[i * block_size, (i + 1) * block_size):

    block table:  | b7 | b2 | b9 | b4 |
    tokens:       |computed..........|new....|free |
                                     ^ num_computed_tokens

With a sliding window W in every layer, a query at position p reads keys p - W + 1 .. p only,
so the blocks wholly before the window of a request's next query are released while it runs
(free_out_of_window), and cache hits that lie before it are never taken:

    block table:  | b7 | b2 | b9 | b4 | b5 |
                  |dropped  |window ...|new |        next query at p, window from p - W + 1
                   ^ req_num_dropped = 2

A dropped block keeps its place in the table (ids stay aligned with positions) but no
reference: every attention path starts at the window's first block, so it is never read again,
whoever holds it by then. It goes back to the free queue still cached, so its prefix stays
reusable by others as long as nobody overwrites it. With full-attention layers beside the
windowed ones (Gemma 2, Qwen2's lower layers) nothing can be dropped.

The manager never picks a victim and never writes into a request: it answers "no room" with
None and the scheduler decides what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

from cbgen.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from cbgen.engine.request import Request


class KVCacheManager:
    """Block tables per request on top of a BlockPool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        """sliding_window: the window of a model whose every layer has one (the largest where
        they differ); None keeps every block of a request until it ends."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.req_num_dropped: dict[str, int] = {}
        """How many of a request's leading blocks it no longer holds (out of every window)."""
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_registered: dict[str, int] = {}
        """How many of a request's leading blocks cache_blocks has already handled."""
        self.num_queries = 0
        """Tokens of admitted requests (prompt + output so far), summed over admissions."""
        self.num_hits = 0
        """Of those, tokens served from the prefix cache."""

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first num_full_blocks blocks (memoised)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _may_hit(self, request: Request) -> bool:
        """Whether the request may take cached K/V: not one with prompt_logprobs, which needs
        the logits of every prompt position (vLLM's rule too). Its blocks are still cached
        for others."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached full blocks of the request's prefix and how many tokens they hold.

        Capped so that at least the last token is computed: sampling needs its logits.
        """
        if not self._may_hit(request):
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._hashes(request, max_blocks)
        tokens = request.all_token_ids
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            parent = hashes[i - 1] if i else None
            block = self.pool.lookup(hashes[i], parent, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def get_partial_block(
        self, request: Request, computed_blocks: Sequence[KVCacheBlock]
    ) -> tuple[KVCacheBlock, int] | None:
        """A partial hit past the request's full hits (computed_blocks): a block to copy the
        first K/V entries of, and how many (at least the last token is left to compute)."""
        if not self._may_hit(request):
            return None
        bs = self.block_size
        i = len(computed_blocks)
        start = i * bs
        if start >= request.num_tokens - 1:
            return None
        # the last hit's own hash and id are the next block's parent (None: no hit yet)
        parent, parent_id = (
            (computed_blocks[-1].block_hash, computed_blocks[-1].block_id) if i else (None, None)
        )
        tokens = request.all_token_ids[start : min(start + bs, request.num_tokens - 1)]
        return self.pool.lookup_partial(parent, parent_id, tokens)

    def _out_of_window(self, num_computed: int) -> int:
        """Leading blocks that no query from position num_computed on reads: those wholly
        before num_computed - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def free_out_of_window(self, request: Request) -> int:
        """Release the request's blocks that its next query's window has left behind (kept in
        the table, unreferenced; see the module docstring). Returns how many were released."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return 0
        done = self.req_num_dropped.get(rid, 0)
        upto = min(self._out_of_window(request.num_computed_tokens), len(blocks))
        if upto <= done:
            return 0
        self.pool.free_blocks(list(reversed(blocks[done:upto])))  # a prefix outlives its tails
        self.req_num_dropped[rid] = upto
        return upto - done

    def max_blocks_held(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks a request of num_tokens in all holds at once when a step computes
        at most max_new_tokens of it: all of them, or under a window those spanning the first
        query's window and the new tokens."""
        need = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return need
        return min(need, self.blocks_needed(self.sliding_window - 1 + max_new_tokens) + 1)

    def new_step(self) -> None:
        """A scheduling step begins: blocks registered before now have their K/V written."""
        self.pool.step += 1

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
        num_partial: int = 0,
    ) -> list[int] | None:
        """Grow the request's block table to hold num_computed_tokens (plus, for a request
        being admitted, the tokens of computed_blocks and of a partial hit) + num_new_tokens.

        Returns the ids of the blocks added (cache hits first), or None, changing nothing,
        when there is no room.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_partial
        )
        need = (
            self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(computed_blocks)
        )
        # Hits before the first query's window are not taken, only placed (see free_out_of_window).
        skip = min(self._out_of_window(num_computed), len(computed_blocks)) if not blocks else 0
        taken = computed_blocks[skip:]
        # Hits sitting idle in the free queue are no longer free once taken.
        idle_hits = sum(1 for b in taken if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - idle_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if not blocks:  # an admission: count its hits once (a retry after "no room" is not)
            self.num_queries += request.num_tokens
            self.num_hits += len(computed_blocks) * self.block_size + num_partial
            if skip:
                self.req_num_dropped[request.request_id] = skip
        self.pool.touch(taken)
        new = self.pool.get_new_blocks(max(need, 0))
        blocks.extend(computed_blocks)
        blocks.extend(new)
        return [b.block_id for b in computed_blocks] + [b.block_id for b in new]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now written.

        Each block is handled once (from the first not yet handled on), so a decode step costs
        O(1) here rather than O(blocks held).
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(self.req_blocks.get(rid, ())))
        # dropped blocks are not the request's any more (another may hold them by now): they
        # were registered before they were dropped, or were cache hits already
        start = max(self.req_num_registered.get(rid, 0), self.req_num_dropped.get(rid, 0))
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        blocks = self.req_blocks[rid]
        tokens = request.all_token_ids
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            parent_id = blocks[i - 1].block_id if i else None
            self.pool.cache_block(
                blocks[i], hashes[i], parent, tokens[i * bs : (i + 1) * bs], parent_id
            )
        self.req_num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that a prefix outlives its tails."""
        blocks = self.req_blocks.pop(request.request_id, [])
        dropped = self.req_num_dropped.pop(request.request_id, 0)
        self.pool.free_blocks(list(reversed(blocks[dropped:])))
        self.req_hashes.pop(request.request_id, None)
        self.req_num_registered.pop(request.request_id, None)

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
