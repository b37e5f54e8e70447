"""Per-request block lists on top of the block pool (vLLM v1 ``core/kv_cache_manager.py``)."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the physical blocks that hold its tokens (its block table).

    Block ``i`` of a request holds the K/V of its tokens ``[i * block_size, (i + 1) * block_size)``.
    Tables grow one block at a time as tokens are scheduled; ``free`` returns them all at once.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's kv_cache_usage)."""
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` tokens after ``request.num_computed_tokens``.

        Returns:
            True if the request's block table now covers
            ``num_computed_tokens + num_new_tokens`` tokens; False (and nothing allocated)
            if the pool has too few free blocks: the scheduler then decides whom to preempt.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        blocks.extend(self.block_pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finished, aborted or preempted)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            # Reverse order: the tail of a sequence is the least likely to be shared later.
            self.block_pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
