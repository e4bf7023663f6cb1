"""Paged KV blocks with prefix caching and LRU eviction.

Every block is either in use (ref_count > 0) or free. Free blocks keep their KV contents and, if
they were full, their hash, so a later prompt with the same prefix reuses them; allocation takes
the least recently freed block and only then forgets its hash. A hit is verified against the
stored token ids, so a hash collision can cost a recompute but never a wrong answer.

Changes to the set of cached hashes are queued as KV events (stored / removed / all cleared) for
routers that track which replica holds which prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from backend_engine.block_hash import hash_block
from backend_engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front = evict first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events: list[dict[str, Any]] = []  # drained by the engine after each step
        self.prefix_queries = 0  # prompt tokens looked up (vLLM counts tokens)
        self.prefix_hits = 0

    # --- accounting -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (free cached blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- hashing --------------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, upto_blocks: int) -> list[int]:
        """Extend seq.block_hashes to cover its first `upto_blocks` full blocks."""
        bs = self.block_size
        while len(seq.block_hashes) < upto_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt))
        return seq.block_hashes[:upto_blocks]

    # --- allocation -----------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens; at least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._block_hashes(seq, full)):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(bid)
        return hits

    def free_after_hits(self, hits: list[int]) -> int:
        """Free blocks left once `hits` are taken (hits sitting in the free list stop being free)."""
        return len(self.free) - sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def allocate_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Attach cached blocks to a newly admitted sequence and mark their tokens computed."""
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free[bid]
            blk.ref_count += 1
        seq.block_table = list(hits)
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens < 0:  # first admission: this is the reported cache hit
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold `num_tokens`; False (nothing taken) if blocks run out."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.block_hash is not None:
            if self.cached.get(blk.block_hash) == bid:
                del self.cached[blk.block_hash]
                self.events.append({"type": "BlockRemoved", "block_hashes": [blk.block_hash]})
            blk.block_hash = None
            blk.token_ids = None
        blk.ref_count = 1
        return bid

    def commit_computed(self, seq: Sequence) -> None:
        """Register blocks whose every token now has KV in the cache as reusable prefix blocks."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_committed_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            h = hashes[i]
            blk = self.blocks[seq.block_table[i]]
            if h in self.cached or blk.block_hash is not None:
                continue  # an identical block is already cached (computed concurrently): keep that one
            blk.block_hash = h
            blk.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = blk.block_id
            self.events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": hashes[i - 1] if i else None,
                    "token_ids": list(blk.token_ids),
                    "block_size": bs,
                }
            )
        seq.num_committed_blocks = full

    def free_sequence(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks are queued for eviction before the prefix they extend,
        and blocks with no hash (partial or duplicate) go to the very front: nothing can reuse them."""
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[bid] = None
                if blk.block_hash is None:
                    self.free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every free cached block (in-use blocks must not exist); False if any are in use."""
        if len(self.free) != self.num_blocks:
            return False
        for blk in self.blocks:
            blk.block_hash = None
            blk.token_ids = None
        self.cached.clear()
        self.events.append({"type": "AllBlocksCleared"})
        return True

    def drain_events(self) -> list[dict[str, Any]]:
        ev, self.events = self.events, []
        return ev
