"""A picture of the KV block pool at one moment, for the live view (``/debug/kv``,
``/dashboard``): every block's state, every queued request's block table, the pool's counters
and the latest forks and copy-on-writes.

Like ``SchedulerStats`` (``stats.py``) it is a frozen value built on the engine thread
(``LLMEngine.make_kv_snapshot``) and read anywhere else; unlike it, it costs
O(num_blocks + block-table entries), so it is built only when someone asks
(``AsyncLLMEngine.get_kv_snapshot``, or at most every ``kv_snapshot_interval`` seconds while a
live view is subscribed). Per-block facts are parallel tuples of small ints, not one object per
block, so that ten thousand blocks serialize to tens of kilobytes of JSON.

The block states are the paper's (Kwon et al. 2023, section 4.3-4.4) as this pool keeps them
(``core/block_pool.py``): free (empty), cached-free (ref count 0, still in the prefix cache, so
a later request can hit it), in use (ref count 1) and shared (ref count > 1: a prefix-cache hit
or a fork).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from pagedllm.core.kv_cache_manager import KVCacheManager, SharingEvent
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler

FREE, CACHED_FREE, IN_USE, SHARED = range(4)
BLOCK_STATES = ("free", "cached_free", "in_use", "shared")  # names of the codes above, in order


def request_id_text(request_id: Any) -> str:
    """A request id as text: the user's string, or ``"{id}[{index}]"`` for a sample of ``n > 1``
    (whose engine id is the tuple ``(id, index)``)."""
    if isinstance(request_id, tuple):
        return f"{request_id[0]}[{request_id[1]}]"
    return str(request_id)


@dataclass(frozen=True)
class RequestBlocks:
    """One queued sequence and the blocks it holds.

    Attributes:
        request_id: its id as text (``request_id_text``).
        status: ``"running"``, ``"waiting"`` (never run) or ``"preempted"`` (waiting to be
            recomputed; like a waiting one it holds no blocks).
        num_prompt_tokens / num_tokens: prompt tokens; prompt + generated tokens.
        num_computed_tokens: tokens whose K/V is in its blocks.
        block_table: physical block id of each logical block (block ``i`` holds tokens
            ``[i * block_size, (i + 1) * block_size)``); empty unless running.
        num_cached_blocks: how many blocks at the head of ``block_table`` were prefix-cache
            hits when it was admitted (a fork inherits its parent's).
        num_preemptions: times it was preempted.
        num_pending_forks: samples of its ``n > 1`` request that will fork off its blocks once
            its prompt is computed.
    """

    request_id: str
    status: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    block_table: tuple[int, ...]
    num_cached_blocks: int
    num_preemptions: int
    num_pending_forks: int


@dataclass(frozen=True)
class KVCounters:
    """The pool's and the queues' counts at the snapshot.

    Attributes:
        num_blocks / num_free_blocks / num_cached_free_blocks / num_used_blocks /
        num_shared_blocks: blocks by state (free includes cached-free; used includes shared).
        num_running / num_waiting / num_preempted: sequences per queue (``num_waiting`` counts
            the preempted ones too, as ``SchedulerStats`` does).
        num_preemptions: preemptions since the engine was built.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found, since the
            engine was built.
        num_evictions: cached blocks reclaimed for new content.
        num_forks / num_copies: forks and copy-on-write copies since the engine was built.
        num_stored_tokens: token slots of in-use blocks whose K/V is written (a shared block
            counts once).
        num_reserved_slots: slots of in-use blocks (``num_used_blocks * block_size``); minus
            ``num_stored_tokens``, the paged pool's waste (the last block's fragmentation).
        num_contiguous_slots: slots a contiguous-reservation system would hold for the running
            sequences: ``min(prompt + max_tokens, max_model_len)`` each (the paper's figure 2
            comparison).
        spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens: speculative decoding's
            drafts verified / accepted since the engine was built.
    """

    num_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_used_blocks: int
    num_shared_blocks: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_forks: int
    num_copies: int
    num_stored_tokens: int
    num_reserved_slots: int
    num_contiguous_slots: int
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0


@dataclass(frozen=True)
class KVCacheSnapshot:
    """The block pool at one moment (``LLMEngine.make_kv_snapshot``).

    Attributes:
        version: 1 for the engine's first snapshot, then +1 per snapshot: two readers holding
            the same version hold the same picture.
        step: the engine step it follows (``IterationStats.step``; 0 before the first).
        block_size: tokens per block.
        block_state: per block id, its state code (``FREE``, ``CACHED_FREE``, ``IN_USE``,
            ``SHARED``; names in ``BLOCK_STATES``).
        ref_count: per block id, how many block tables hold it.
        owner: per block id, the index in ``requests`` of the first request whose table holds
            it (-1 when none; a shared block's other owners are in their tables).
        requests: running sequences (oldest first), then waiting ones (next to run first).
        counters: the counts (``KVCounters``).
        events: the latest forks and copy-on-writes, oldest first (a bounded window:
            ``SharingEvent.serial`` tells how many came before).
    """

    version: int
    step: int
    block_size: int
    block_state: tuple[int, ...]
    ref_count: tuple[int, ...]
    owner: tuple[int, ...]
    requests: tuple[RequestBlocks, ...]
    counters: KVCounters
    events: tuple[SharingEvent, ...]

    def to_dict(self) -> dict:
        """The JSON form served at ``/debug/kv`` (documented in docs/dashboard.md)."""
        counters = dict(vars(self.counters))  # not asdict(): it deep-copies every table entry
        counters.update(kv_cache_usage=self.counters.kv_cache_usage,
                        prefix_cache_hit_rate=self.counters.prefix_cache_hit_rate,
                        spec_decode_acceptance_rate=self.counters.spec_decode_acceptance_rate)
        return {
            "version": self.version,
            "step": self.step,
            "block_size": self.block_size,
            "num_blocks": len(self.block_state),
            "block_states": list(BLOCK_STATES),
            "blocks": {"state": self.block_state, "ref_count": self.ref_count, "owner": self.owner},
            "requests": [dict(vars(request)) for request in self.requests],
            "counters": counters,
            "events": [_event_dict(event) for event in self.events],
        }

    @functools.cached_property
    def json(self) -> str:
        """``to_dict()`` as compact JSON text, built once per snapshot (every live reader of
        the same version shares it)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _event_dict(event: SharingEvent) -> dict:
    """A fork's or a copy's fields that apply to it, ids as text."""
    fields = {key: value for key, value in event._asdict().items() if value is not None}
    fields["request_id"] = request_id_text(event.request_id)
    if event.parent_id is not None:
        fields["parent_id"] = request_id_text(event.parent_id)
    return fields


def make_kv_snapshot(version: int, step: int, scheduler: Scheduler, kv_cache_manager: KVCacheManager,
                     max_model_len: int) -> KVCacheSnapshot:
    """Read the scheduler's queues and the manager's tables and pool into a snapshot.

    Read-only: changes nothing in either. Engine thread only (they are not thread-safe).
    O(num_blocks + total block-table length + queued requests).
    """
    pool = kv_cache_manager.block_pool
    ref_counts, in_cache = pool.block_states()
    block_state = [(SHARED if count > 1 else IN_USE) if count else (CACHED_FREE if cached else FREE)
                   for count, cached in zip(ref_counts, in_cache)]
    owner = [-1] * len(ref_counts)
    requests = []
    queued: list[Request] = [*scheduler.running, *scheduler.waiting]
    for index, request in enumerate(queued):
        table = kv_cache_manager.get_block_ids(request.request_id)
        for block_id in table:
            if owner[block_id] < 0:
                owner[block_id] = index
        status = request.status
        requests.append(RequestBlocks(
            request_id=request_id_text(request.request_id),
            status="preempted" if status == RequestStatus.PREEMPTED else status.value,
            num_prompt_tokens=request.num_prompt_tokens, num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens, block_table=tuple(table),
            num_cached_blocks=kv_cache_manager.get_num_hit_blocks(request.request_id),
            num_preemptions=request.num_preemptions, num_pending_forks=len(request.pending_forks)))
    stats = kv_cache_manager.get_stats()
    block_size = kv_cache_manager.block_size
    contiguous = sum(min(request.num_prompt_tokens + request.max_tokens, max_model_len)
                     for request in scheduler.running)
    counters = KVCounters(
        num_blocks=stats.num_blocks, num_free_blocks=stats.num_cached_free_blocks + stats.num_empty_free_blocks,
        num_cached_free_blocks=stats.num_cached_free_blocks, num_used_blocks=stats.num_used_blocks,
        num_shared_blocks=stats.num_shared_blocks, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=sum(1 for request in scheduler.waiting if request.status == RequestStatus.PREEMPTED),
        num_preemptions=scheduler.num_preemptions, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, num_evictions=stats.num_evictions,
        num_forks=kv_cache_manager.num_forks, num_copies=kv_cache_manager.num_copies,
        num_stored_tokens=stats.num_stored_tokens, num_reserved_slots=stats.num_used_blocks * block_size,
        num_contiguous_slots=contiguous, spec_decode_num_draft_tokens=scheduler.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=scheduler.spec_decode_num_accepted_tokens)
    return KVCacheSnapshot(version=version, step=step, block_size=block_size, block_state=tuple(block_state),
                           ref_count=tuple(ref_counts), owner=tuple(owner), requests=tuple(requests),
                           counters=counters, events=tuple(kv_cache_manager.recent_events))
