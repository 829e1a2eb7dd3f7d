"""BlockPool: which KV blocks exist, who holds them (reference counts), which are cached.

A block whose count drops to 0 goes to the back of the free queue; new blocks come from the
front, so the queue is also the eviction order of the prefix cache (least recently freed
first). A full block may carry a hash of (parent hash, its token ids): while it sits in the free
queue its contents stay reusable by any request whose prefix hashes the same and whose parent
hash and token ids match. Each hit is checked against the stored (parent hash, token ids), and
a prefix is walked from its first block, stopping at the first miss: so a forced equal hash (a
collision) never shares a block, whether the two blocks differ in their tokens or only in what
precedes them.

A shared prefix rarely ends on a block boundary. Past the last full hit, the request may also
take the first tokens of a cached block that follows the same block it does (the best match
among up to BlockPool.MAX_CHILDREN remembered): those tokens' K/V is copied into the request's
own next block before the step runs (a partial hit), so the prefix is reused down to the
token. Only blocks registered in an earlier step qualify: blocks are registered when
scheduled, before the forward pass writes them.

Block tables per request on top of the pool: cbgen.engine.kv_cache.KVCacheManager.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained, deterministic hash of one full block (sha256; stable across processes)."""
    h = hashlib.sha256(parent or b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    """The hash of the block before this one in its sequence (None for a first block)."""
    token_ids: tuple[int, ...] | None = None
    """The tokens a cached block holds; with parent_hash, checked on every hit."""
    parent_block_id: int | None = None
    """The block before this one in the sequence it was cached from (None for a first block)."""
    cached_step: int = -1
    """The scheduling step that registered it (its K/V is written once that step has run)."""


class BlockPool:
    """All blocks, the free queue (eviction order) and the hash -> block index."""

    MAX_CHILDREN = 4
    """Blocks remembered per parent for partial hits (a step's own registrations do not
    qualify until the next step, and they only replace each other, not earlier ones)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.children: dict[BlockHash | None, list[int]] = {}
        """Parent hash (None: no parent) -> blocks cached after it (at most MAX_CHILDREN,
        oldest first): where partial hits copy from."""
        self.step = 0
        """Scheduling steps so far (KVCacheManager.new_step)."""
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue (evicting their cached contents)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            siblings = self.children.get(block.parent_hash)
            if siblings is not None and block.block_id in siblings:
                siblings.remove(block.block_id)
                if not siblings:
                    del self.children[block.parent_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = None
            self.num_evictions += 1

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order
        (so pass the ones to evict first, first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The cached block with this hash, if it holds these tokens after this parent."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None  # a hash collision: never share
        return block

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        parent_block_id: int | None = None,
    ) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds these tokens; this one stays private
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.parent_block_id = parent_block_id
        block.cached_step = self.step
        self.cached[block_hash] = block.block_id
        siblings = self.children.setdefault(parent_hash, [])
        siblings.append(block.block_id)
        if len(siblings) > self.MAX_CHILDREN:
            # drop the oldest block registered in this step, if another is: the blocks of
            # earlier steps are the ones a partial hit can use now (many requests admitted in
            # one step would otherwise push them all out)
            now = [i for i in siblings[:-1] if self.blocks[i].cached_step == self.step]
            siblings.remove(now[0] if now else siblings[0])

    def lookup_partial(
        self, parent_hash: BlockHash | None, parent_block_id: int | None, token_ids: Sequence[int]
    ) -> tuple[KVCacheBlock, int] | None:
        """Of the last blocks cached after this parent (the same block, not only the same hash)
        in an earlier step, the one whose first tokens match token_ids' longest, and how many
        match; None if none do."""
        best: tuple[KVCacheBlock, int] | None = None
        for block_id in reversed(self.children.get(parent_hash, ())):
            block = self.blocks[block_id]
            if (
                block.parent_block_id != parent_block_id
                or block.cached_step >= self.step
                or block.token_ids is None
            ):
                continue
            n = 0
            for a, b in zip(block.token_ids, token_ids, strict=False):  # token_ids may be shorter
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (block, n)
        return best

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
