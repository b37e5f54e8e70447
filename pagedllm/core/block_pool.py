"""The physical KV blocks: free queue, reference counts and the prefix cache (vLLM v1
``core/block_pool.py``).

A block is a page of the KV cache: ``block_size`` token slots in every layer's K and V pool.
This module only tracks block ids; the tensors live in the model runner.

A block's life::

    free ──allocate──> in use (ref_count >= 1) ──cache_block──> in use + cached
     ^                    │                                        │ free (ref_count -> 0)
     │                    │ free                                   v
     └────────────────────┴──────── evicted on allocate <──── cached-free (still hit-able)

Invariants (checked by ``check_invariants``):
    * ``num_free_blocks + num_used_blocks == num_blocks``;
    * a block with ``ref_count > 0`` is never in the free queue, and every block in the free
      queue has ``ref_count == 0``;
    * every entry of the hash map points at a block whose ``block_hash`` has that value, and
      every block with a ``cache_id`` is in the map; cached blocks are never written again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

BlockHashFn = Callable[[tuple], int]


class BlockHash(NamedTuple):
    """What a full block holds, as the prefix cache identifies it.

    Attributes:
        value: ``hash_fn((parent_value, token_ids, extra_keys))``; the map key. Only a hint:
            a hit also compares ``token_ids``, ``extra_keys`` and the parent block's
            ``cache_id``, so a collision can never return another prefix's KV.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: other inputs the KV depends on (``cache_salt`` and the LoRA adapter id in a
            sequence's first block).
    """

    value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple


class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: index into the KV tensors' first dimension.
        ref_count: number of sequences whose block table holds this block.
        block_hash: set while the block is in the prefix cache.
        cache_id: unique (over the pool's lifetime) id given when the block was cached; a
            child block records its parent's, so a chain of hits is verified link by link
            even when hash values collide or a parent was evicted and its id reused.
        parent_cache_id: the ``cache_id`` of the block before it in its sequence (None for
            a first block).
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "cache_id", "parent_cache_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[BlockHash] = None
        self.cache_id: Optional[int] = None
        self.parent_cache_id: Optional[int] = None

    def __repr__(self) -> str:
        return (f"KVCacheBlock(id={self.block_id}, ref_count={self.ref_count}, "
                f"cached={self.cache_id is not None})")


@dataclass
class BlockPoolStats:
    """A snapshot of the pool, in blocks.

    Attributes:
        num_blocks: total.
        num_used_blocks: blocks with ``ref_count >= 1``.
        num_cached_free_blocks: ``ref_count == 0`` but still in the prefix cache.
        num_empty_free_blocks: ``ref_count == 0`` and holding nothing reusable.
        num_shared_blocks: blocks referenced by more than one sequence.
        num_evictions: cached blocks reclaimed for new content since the pool was built.
    """

    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_empty_free_blocks: int
    num_shared_blocks: int
    num_evictions: int


class BlockPool:
    """A fixed set of ``num_blocks`` blocks, a free queue and the prefix-cache map.

    The free queue is an insertion-ordered dict used as an ordered set: allocation takes from
    the front, freed blocks go to the back, and a cached-free block that is hit again leaves
    from the middle, all in O(1) (vLLM uses a doubly linked list for the same). Freed blocks
    keep their cached contents, so eviction is least-recently-freed first.

    A freed block that holds no cached content (prefix caching off, or a request's partial
    last block) has nothing worth keeping: it goes on a stack of recycled blocks that
    ``allocate`` takes from first, most recently freed first. Such a block is warm (its pages
    are mapped and its lines may still be in cache, where a never-used block of the lazily
    mapped pool costs page faults on first write), and cached blocks are evicted only once no
    recycled block is left. (vLLM queues every freed block behind the others; its pool is
    zero-filled up front.)

    Args:
        num_blocks: total number of blocks in the pool (>= 1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # never used, or cached-free
        self._recycled: list[int] = []  # freed without cached content; taken from the end
        self._cached: dict[int, KVCacheBlock] = {}
        self._next_cache_id = itertools.count()
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out (empty or cached-free)."""
        return len(self._free) + len(self._recycled)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in the order ``allocate`` hands them out; O(num free)."""
        return self._recycled[::-1] + list(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` blocks, each with ref_count 1: recycled blocks first (the most
        recently freed first), then from the front of the free queue.

        A cached-free block taken this way is evicted: it leaves the prefix cache.

        Raises:
            ValueError: if fewer than ``count`` blocks are free (callers check first).
        """
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            if self._recycled:
                block_id = self._recycled.pop()
            else:
                block_id = next(iter(self._free))
                del self._free[block_id]
            block = self.blocks[block_id]
            assert block.ref_count == 0, block
            if block.cache_id is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block (a cache hit or a fork); a cached-free block
        leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                if block.block_id in self._free:
                    del self._free[block.block_id]
                else:  # not reached by the engine (only cached blocks are hit when free)
                    self._recycled.remove(block.block_id)
            block.ref_count += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the queue,
        keeping their cached contents until evicted, or, holding none, onto the recycled
        stack. Blocks are freed in the order given, so the last one is allocated first."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.cache_id is None:
                    self._recycled.append(block.block_id)
                else:
                    self._free[block.block_id] = None

    # ----------------------------------------------------------------------------- prefix cache
    def get_cached_block(self, block_hash: BlockHash,
                         parent_cache_id: Optional[int]) -> Optional[KVCacheBlock]:
        """The cached block holding exactly ``block_hash``'s tokens after the given parent.

        Args:
            block_hash: the wanted content.
            parent_cache_id: ``cache_id`` of the block matched just before (None for the
                first block of a sequence).

        Returns:
            The block, or None on a miss, including a hash collision with other content.
        """
        block = self._cached.get(block_hash.value)
        if block is None or block.parent_cache_id != parent_cache_id:
            return None
        cached_hash = block.block_hash
        assert cached_hash is not None, block  # a block in _cached has its hash
        if cached_hash.token_ids != block_hash.token_ids or cached_hash.extra_keys != block_hash.extra_keys:
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    parent_cache_id: Optional[int]) -> bool:
        """Offer a full block, whose K/V is already written, to later requests.

        Returns:
            False (and nothing changes) when another block is cached under the same hash
            value: the first one keeps the slot, and this block simply is not shareable.
        """
        assert block.ref_count > 0 and block.cache_id is None, block
        if block_hash.value in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_cache_id = parent_cache_id
        block.cache_id = next(self._next_cache_id)
        self._cached[block_hash.value] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in use or free. Blocks in use keep their contents and
        owners; they are just no longer offered to new requests."""
        for block in list(self._cached.values()):
            self._uncache(block)
            if block.ref_count == 0:  # now free without content: recycled like any such block
                del self._free[block.block_id]
                self._recycled.append(block.block_id)

    def _uncache(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None, block  # only a cached block is uncached
        del self._cached[block.block_hash.value]
        block.block_hash = None
        block.cache_id = None
        block.parent_cache_id = None

    # ----------------------------------------------------------------------------- observers
    def block_states(self) -> tuple[list[int], list[bool]]:
        """Per block, in block-id order: its ref count, and whether it is in the prefix cache
        (hit-able). Read-only; O(num_blocks), for snapshots taken on the engine thread."""
        blocks = self.blocks
        return [block.ref_count for block in blocks], [block.cache_id is not None for block in blocks]

    # ----------------------------------------------------------------------------- checks
    def get_stats(self) -> BlockPoolStats:
        """Count the blocks by state; O(num_blocks)."""
        cached_free = sum(1 for block_id in self._free if self.blocks[block_id].cache_id is not None)
        free = self.num_free_blocks
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_free_blocks=cached_free,
            num_empty_free_blocks=free - cached_free,
            num_shared_blocks=sum(1 for block in self.blocks if block.ref_count > 1),
            num_evictions=self.num_evictions,
        )

    def check_invariants(self) -> None:
        """Assert the pool invariants; O(num_blocks), for tests and debugging."""
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        recycled = set(self._recycled)
        assert len(recycled) == len(self._recycled) and not recycled & self._free.keys()
        for block in self.blocks:
            in_free = block.block_id in self._free or block.block_id in recycled
            assert in_free == (block.ref_count == 0), block
            assert block.block_id not in recycled or block.cache_id is None, block
            assert block.ref_count >= 0, block
            if block.cache_id is None:
                assert block.block_hash is None and block.parent_cache_id is None, block
            else:
                assert block.block_hash is not None and self._cached.get(block.block_hash.value) is block, block
        for value, block in self._cached.items():
            assert block.block_hash is not None and block.block_hash.value == value, block
