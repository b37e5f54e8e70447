"""The physical KV blocks: free list and reference counts (vLLM v1 ``core/block_pool.py``).

A block is a page of the KV cache: ``block_size`` token slots in every layer's K and V pool.
This module only tracks block ids; the tensors live in the model runner.

Invariants (checked by ``check_invariants``):
    * ``num_free_blocks + num_used_blocks == num_blocks``;
    * a block with ``ref_count > 0`` is never in the free queue, and every block in the free
      queue has ``ref_count == 0``.
"""

from __future__ import annotations


class KVCacheBlock:
    """Metadata of one physical block: its id and how many sequences reference it."""

    __slots__ = ("block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_count={self.ref_count})"


class BlockPool:
    """A fixed set of ``num_blocks`` blocks with a FIFO free queue.

    The free queue is an insertion-ordered dict used as an ordered set, so a block can be
    taken from the front in O(1) and, later, out of the middle in O(1) (what vLLM does with a
    doubly linked list).

    Args:
        num_blocks: total number of blocks in the pool (>= 1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Take ``count`` blocks from the front of the free queue, each with ref_count 1.

        Raises:
            ValueError: if fewer than ``count`` blocks are free (callers check first).
        """
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks: only {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id = next(iter(self._free))
            del self._free[block_id]
            block = self.blocks[block_id]
            assert block.ref_count == 0, block
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the queue."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def check_invariants(self) -> None:
        """Assert the pool invariants; O(num_blocks), for tests and debugging."""
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), block
