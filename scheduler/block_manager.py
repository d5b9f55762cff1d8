"""Paged KV block manager with reference counts and the prefix cache.

Block 0 is reserved as the null block: it is never handed to a request, so a
runner may point padding tokens (CUDA-graph padding) at it. Blocks
``1 .. num_blocks-1`` are usable.

Free blocks wait in one queue, in eviction order. Allocation takes the
front. When a request frees its blocks, blocks without a hash go to the
front (nothing to keep) and hashed blocks go to the back in reverse order
(tail of the prompt first), so the cache evicts least recently used blocks
first and a prefix's first blocks last. A cached block whose ref count is 0
stays findable until it is taken for a new allocation (then its hash is
dropped) — that is LRU eviction of unreferenced cached blocks.

A block is cached (hash recorded) when it is full and scheduled to be
computed; if another block already holds that hash the newer one simply
stays uncached. Lookups stop at the first miss and never cover the whole
prompt: at least one token is always computed, so the request has a row
to sample from.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from detent.scheduler.block_hash import BlockHash

if TYPE_CHECKING:
    from detent.scheduler.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._num_cached_blocks: dict[str, int] = {}  # request id -> blocks already hashed
        self.queries = 0  # prefix-cache lookups: tokens asked for, tokens hit
        self.hits = 0

    # ------------------------------------------------------------ queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_usable_blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, req: "Request") -> list[int]:
        """Longest run of cached blocks matching the request's leading full
        blocks, capped so that at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:limit]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int, enabled: bool = True) -> None:
        """Count an admitted request's lookup for the hit rate."""
        if self.enable_prefix_caching and enabled:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def can_allocate(self, req: "Request", num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        return self._num_needed(req, num_new_tokens, cached_blocks) <= len(self.free)

    def _num_needed(self, req: "Request", num_new_tokens: int, cached_blocks) -> int:
        have = len(req.block_ids) + len(cached_blocks)
        total = self.blocks_for(req.num_computed_tokens + len(cached_blocks) * self.block_size
                                + num_new_tokens)
        # cached blocks nobody references sit in the free queue: taking them uses it up too
        revived = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        return max(total - have, 0) + revived

    # ------------------------------------------------------------ mutations
    def allocate(self, req: "Request", num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `req` the cached blocks (a prefix hit) and enough new blocks
        for `num_new_tokens` more tokens after them. False (and no change)
        if the pool is short. The caller advances num_computed_tokens over
        the cached blocks."""
        if not self.can_allocate(req, num_new_tokens, cached_blocks):
            return False
        for b in cached_blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        req.block_ids.extend(cached_blocks)
        n_done = req.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_for(n_done + num_new_tokens) - len(req.block_ids)
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the least recently used unreferenced cached block
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            req.block_ids.append(b)
        self._cache_full_blocks(req, n_done + num_new_tokens)
        return True

    def _cache_full_blocks(self, req: "Request", num_tokens: int) -> None:
        """Record the hashes of the request's blocks that are full once
        `num_tokens` tokens are computed (blocks hit in the cache already are)."""
        rid = req.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        if self.enable_prefix_caching:
            for i in range(start, end):
                b, h = req.block_ids[i], req.block_hashes[i]
                if self.block_hash[b] is None and h not in self.cached:
                    self.block_hash[b] = h
                    self.cached[h] = b
        self._num_cached_blocks[rid] = max(start, end)

    def uncache_from(self, req: "Request", position: int) -> None:
        """Forget the cached hashes of the request's blocks holding positions >=
        `position` (a step that failed may not have written their KV)."""
        for b in req.block_ids[position // self.block_size:]:
            h = self.block_hash[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
        n = self._num_cached_blocks.get(req.request_id)
        if n is not None:
            self._num_cached_blocks[req.request_id] = min(n, position // self.block_size)

    def free_request(self, req: "Request") -> None:
        """Drop the request's references; blocks whose count reaches 0 join
        the free queue (cached ones stay findable until reused)."""
        for b in reversed(req.block_ids):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed twice"
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)
        req.block_ids = []
        self._num_cached_blocks.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if len(self.free) != self.num_usable_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.free = OrderedDict((b, None) for b in range(1, self.num_blocks))
        self.queries = self.hits = 0
        return True
