"""Per-request block tables on top of the block pool (vLLM v1 ``core/kv_cache_manager.py``),
plus the paper's sharing mechanism that vLLM v1 dropped: forking a sequence and copy-on-write
(Kwon et al. 2023, section 4.4).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from pagedllm.core.block_pool import BlockHash, BlockHashFn, BlockPool, BlockPoolStats, KVCacheBlock
from pagedllm.core.request import Request, RequestId
from pagedllm.utils import cdiv


@dataclass
class KVCacheStats(BlockPoolStats):
    """The pool's block counts plus token-level figures (what ``LLM.get_kv_cache_stats`` returns).

    Attributes:
        block_size: tokens per block.
        num_stored_tokens: token slots of in-use blocks whose K/V is written (a shared block
            counts once).
        num_empty_slots: slots of in-use blocks that hold nothing yet (internal fragmentation
            plus slots reserved for the tokens being computed).
        prefix_cache_queries: prompt tokens looked up in the prefix cache at admission.
        prefix_cache_hits: of those, tokens whose K/V was found.
    """

    block_size: int = 0
    num_stored_tokens: int = 0
    num_empty_slots: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class SharingEvent(NamedTuple):
    """A fork or a copy-on-write, as the manager performed it (kept for observers).

    Attributes:
        serial: 0 for the manager's first event, then +1 per event.
        kind: ``"fork"`` (``request_id`` took ``parent_id``'s whole table, ``num_blocks``
            blocks, ref count + 1 each) or ``"copy"`` (``request_id`` was about to write into
            its logical block ``logical_index``, physical ``src_block_id``, which others also
            held: it got the private copy ``dst_block_id``).
        request_id: the child of a fork, the writer of a copy.
        parent_id: the parent of a fork (None for a copy).
        num_blocks: blocks shared by a fork (1 for a copy).
        logical_index: the copied block's index in the writer's table (None for a fork).
        src_block_id / dst_block_id: the copy's physical blocks (None for a fork).
    """

    serial: int
    kind: str
    request_id: Any
    parent_id: Any = None
    num_blocks: int = 1
    logical_index: Optional[int] = None
    src_block_id: Optional[int] = None
    dst_block_id: Optional[int] = None


def request_extra_keys(request: Request) -> tuple:
    """The first block's extra keys: the ``cache_salt`` (a string) and the LoRA adapter's
    ``lora_int_id`` (an int), each when set (vLLM's ``generate_block_hash_extra_keys``). The
    K/V of a prompt depends on the adapter, so no block is shared across adapters."""
    keys: tuple = ()
    if request.cache_salt is not None:
        keys += (request.cache_salt,)
    if request.lora_request is not None:
        keys += (request.lora_request.lora_int_id,)
    return keys


class KVCacheManager:
    """Maps each request to the physical blocks that hold its tokens (its block table).

    Block ``i`` of a request holds the K/V of its tokens ``[i * block_size, (i + 1) * block_size)``.
    Tables grow one block at a time as tokens are scheduled; ``free`` returns them all at once.

    Prefix caching: the key of a request's full block ``i`` is chained,
    ``hash_fn((key of block i-1, token ids of block i, extra keys))``, with the request's
    ``cache_salt`` and LoRA adapter id as the first block's extra keys (``request_extra_keys``),
    so two requests share block ``i`` only if all tokens up to its end, their salts and their
    adapters are equal. A block is cached by ``cache_blocks``
    after the step that wrote its K/V, never before.

    Sharing: ``fork`` gives a child the parent's table (ref count + 1 per block). Before a
    sequence writes into a block that other sequences also hold, ``allocate_slots`` gives it
    a private copy and queues ``(src, dst)`` for the model runner (``take_pending_copies``).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: offer and reuse full blocks through the prefix cache.
        hash_fn: maps ``(parent_value, token_ids, extra_keys)`` to an int; Python's ``hash``
            by default. Hits are verified, so a weak function only costs hit rate.
        max_recent_events: how many of the latest ``SharingEvent``s ``recent_events`` keeps.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_fn: BlockHashFn = hash, max_recent_events: int = 64) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        self._requests: dict[RequestId, Request] = {}
        self._block_hashes: dict[RequestId, list[BlockHash]] = {}
        self._num_cached_blocks: dict[RequestId, int] = {}
        self._num_hit_blocks: dict[RequestId, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.num_copies = 0
        self.num_forks = 0
        # Bounded, so a long-running server keeps only what a live view can show.
        self.recent_events: deque[SharingEvent] = deque(maxlen=max_recent_events)
        self._event_serials = itertools.count()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's kv_cache_usage)."""
        return self.block_pool.num_used_blocks / self.block_pool.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------------------------- prefix cache
    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Keys of the request's first ``num_blocks`` full blocks (computed once, then kept)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        block_size = self.block_size
        token_ids = None
        for index in range(len(hashes), num_blocks):
            if token_ids is None:
                token_ids = request.all_token_ids
            block_tokens = tuple(token_ids[index * block_size:(index + 1) * block_size])
            assert len(block_tokens) == block_size, "only full blocks have a key"
            parent_value = hashes[-1].value if hashes else None
            extra_keys = request_extra_keys(request) if index == 0 else ()
            hashes.append(BlockHash(self.hash_fn((parent_value, block_tokens, extra_keys)),
                                    block_tokens, extra_keys))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that has no blocks yet.

        At most ``num_tokens - 1`` tokens are returned as hits so that the last token is
        always computed: its logits are needed to sample (vLLM does the same).

        Returns:
            ``(blocks, num_computed_tokens)``; nothing is referenced yet, pass both to
            ``allocate_slots``.
        """
        if not self.enable_caching:
            return [], 0
        if (request.sampling_params.prompt_logprobs is not None
                and len(request.prompt_logprobs) < request.num_prompt_tokens):
            # Prompt logprobs need the logits of every prompt position (vLLM skips the cache too).
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        parent_cache_id = None
        for block_hash in self.block_hashes(request, max_blocks):
            block = self.block_pool.get_cached_block(block_hash, parent_cache_id)
            if block is None:
                break
            blocks.append(block)
            parent_cache_id = block.cache_id
        return blocks, len(blocks) * self.block_size

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's full blocks whose K/V is written (call after the step that
        advanced ``num_computed_tokens``). A block is cached only if its parent is."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        table = self.req_to_blocks[request.request_id]
        hashes = self.block_hashes(request, num_full)
        for index in range(start, num_full):
            block = table[index]
            if block.cache_id is not None:
                continue  # a hit, or shared with the sequence it was forked from
            parent_cache_id = table[index - 1].cache_id if index else None
            if index and parent_cache_id is None:
                break  # the chain is broken (a collision or a reset): nothing after is offered
            self.block_pool.cache_block(block, hashes[index], parent_cache_id)
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget all cached blocks (including those of running requests, which keep their
        KV but stop offering it). Never refuses; the query/hit counters are kept."""
        self.block_pool.reset_prefix_cache()

    # ----------------------------------------------------------------------------- tables
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        The computed ones are ``request.num_computed_tokens + num_new_computed_tokens``; the
        latter are prefix-cache hits (``new_computed_blocks``, from ``get_computed_blocks``),
        taken only at admission. Every block that the new tokens will be written into and
        that another sequence also holds is replaced by a private copy (copy-on-write).

        Returns:
            True if the request's block table now covers all those tokens; False, with
            nothing changed, if the pool has too few free blocks: the scheduler then decides
            whom to preempt.
        """
        new_computed_blocks = new_computed_blocks or []
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, [])
        assert not (blocks and new_computed_blocks), "cache hits are only taken at admission"
        first_written = request.num_computed_tokens + num_new_computed_tokens
        num_total = first_written + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_needed(num_total) - len(blocks) - len(new_computed_blocks))
        shared = [index for index in range(first_written // self.block_size, len(blocks))
                  if blocks[index].ref_count > 1]
        num_revived = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if num_new_blocks + len(shared) + num_revived > self.block_pool.num_free_blocks:
            return False

        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = blocks
            self._requests[request_id] = request
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        # Hits first: reviving them takes them off the free queue before allocate() could
        # evict them.
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[request_id] = len(new_computed_blocks)
            self._num_hit_blocks[request_id] = len(new_computed_blocks)
        for index in shared:
            (copy,) = self.block_pool.allocate(1)
            self._pending_copies.append((blocks[index].block_id, copy.block_id))
            self.num_copies += 1
            self.recent_events.append(SharingEvent(next(self._event_serials), "copy", request_id,
                                                   logical_index=index, src_block_id=blocks[index].block_id,
                                                   dst_block_id=copy.block_id))
            self.block_pool.free([blocks[index]])
            blocks[index] = copy
        blocks.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table, sharing every block (ref count + 1).

        The child must have no blocks and the same tokens as the parent up to
        ``parent.num_computed_tokens``.
        """
        assert child.request_id not in self.req_to_blocks, child
        blocks = list(self.req_to_blocks[parent.request_id])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        self._requests[child.request_id] = child
        num_shared_full = parent.num_computed_tokens // self.block_size
        self._block_hashes[child.request_id] = self.block_hashes(parent, num_shared_full)
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_shared_full)
        # The parent's hit blocks are in the child's table too (never copied: they are full).
        self._num_hit_blocks[child.request_id] = self._num_hit_blocks.get(parent.request_id, 0)
        self.num_forks += 1
        self.recent_events.append(SharingEvent(next(self._event_serials), "fork", child.request_id,
                                               parent_id=parent.request_id, num_blocks=len(blocks)))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The ``(src_block_id, dst_block_id)`` copies the model runner must apply before the
        next forward; the list is emptied."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finished, aborted or preempted)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._num_hit_blocks.pop(request_id, None)
        if not blocks:
            return
        if self._pending_copies:
            # A private copy freed before the forward that fills it must not be filled later.
            mine = {block.block_id for block in blocks}
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst not in mine]
        # Reverse order: the tail of a sequence is the least likely to be shared later, so
        # it is the first to be evicted.
        self.block_pool.free(list(reversed(blocks)))

    def free_blocks_after(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those that hold its first ``num_tokens`` tokens: after
        a speculative step, the blocks allocated for drafts that were rejected. Such a block
        was allocated this step and written only with rejected K/V, so it is neither shared
        nor cached, and it goes back to the free pool without a key."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        assert all(block.ref_count == 1 and block.cache_id is None for block in tail), tail
        self.block_pool.free(list(reversed(tail)))

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        """The request's block table: physical block id per logical block ([] without blocks)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_num_hit_blocks(self, request_id: RequestId) -> int:
        """How many blocks at the head of the request's current table were prefix-cache hits
        when it was admitted (inherited by a fork); 0 without blocks."""
        return self._num_hit_blocks.get(request_id, 0)

    # ----------------------------------------------------------------------------- accounting
    def get_stats(self) -> KVCacheStats:
        """Blocks by state, written tokens vs empty slots, prefix-cache queries and hits."""
        block_size = self.block_size
        filled: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            num_computed = self._requests[request_id].num_computed_tokens
            for index, block in enumerate(blocks):
                count = min(block_size, max(0, num_computed - index * block_size))
                if count > filled.get(block.block_id, -1):
                    filled[block.block_id] = count
        pool = self.block_pool.get_stats()
        stored = sum(filled.values())
        return KVCacheStats(**vars(pool), block_size=block_size, num_stored_tokens=stored,
                            num_empty_slots=pool.num_used_blocks * block_size - stored,
                            prefix_cache_queries=self.prefix_cache_queries,
                            prefix_cache_hits=self.prefix_cache_hits)
