"""Continuous batching with chunked prefill and preemption (vLLM v1 ``core/sched/scheduler.py``).

Policy only: who runs this step and with how many tokens. Which physical block holds what is
the KV cache manager's business; tensors are the model runner's.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestId, RequestStatus

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")
# Share of the pool kept free when a request is admitted beside running ones, for their decode
# growth (vLLM v0's block manager ``watermark``, default 0.01).
WATERMARK = 0.01


@dataclass
class SchedulerOutput:
    """What the model runs in one step.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` pairs; the request computes its tokens
            ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.
        preempted: requests whose blocks were taken back during this schedule call.
        blocks_to_copy: ``(src_block_id, dst_block_id)`` copy-on-write copies to apply
            before the forward.
        lora_ids_in_use: the LoRA adapters (``lora_int_id``) of every running request after
            this schedule, scheduled in this step or not; at most ``max_loras`` of them.
        scheduled_spec_decode_tokens: request_id -> the draft tokens it verifies this step
            (vLLM's name). Such a request's ``num_new_tokens`` is ``1 + len(drafts)``: its
            last token, then the drafts, at the positions that follow.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    lora_ids_in_use: frozenset[int] = frozenset()
    scheduled_spec_decode_tokens: dict[RequestId, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching under a per-step token budget, first-come-first-served or by priority.

    Each step walks the running requests first (oldest first), then admits waiting ones while
    the budget ``max_num_batched_tokens``, the ``max_num_seqs`` limit and free blocks allow. A
    prompt longer than the budget is prefilled in chunks over several steps, but a request is
    admitted beside running ones only if the free blocks hold its whole prompt and a watermark
    of 1 % of the pool for decode growth (vLLM v0's ``BlockSpaceManager.can_allocate``; vLLM v1
    checks only the first chunk). Admitted on its first chunk alone, a burst of long documents
    fills the pool with half-prefilled prompts that then preempt one another, each preemption
    costing a whole prompt's recompute (docs/benchmarks/serving-size.md, "Capacity"). With
    nothing running, the first chunk's blocks are enough. When a running request needs a
    block and none is free, the most recently arrived running request is
    preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
    recomputed (prompt and generated tokens) when it is admitted again. Admission first takes
    the longest cached prefix (``get_computed_blocks``) and only then derives the tokens left
    to compute, so a resumed request skips what it or others left in the prefix cache. An
    ``n > 1`` request is admitted as its first sample with seats reserved for the others,
    which fork off its blocks once the prompt is computed.

    Policies (vLLM v1 ``SchedulingPolicy``, ``vllm/v1/core/sched/scheduler.py``):

    - ``fcfs``: the order is arrival: running requests oldest first, the victim the most
      recently arrived running request, the waiting queue in arrival order (a preempted
      request goes back to its front).
    - ``priority``: the order is ``(priority, arrival_time)``, lower first, as vLLM's
      ``PriorityRequestQueue``: the waiting queue is admitted in that order, running requests
      take the budget in that order, and under block pressure the victim is the running
      request with the largest key (lowest priority, latest arrival), vLLM's
      ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``. Like vLLM, a
      waiting request never preempts a running one: priority decides who gets the next free
      seat and who loses its blocks, not who is evicted to make room.

    Starvation under ``priority`` is bounded by aging (vLLM has none): a request's effective
    priority is ``priority - floor(seconds since arrival / priority_aging_interval)``, so one
    that has waited ``(p - q) * priority_aging_interval`` seconds is ordered before every
    request of priority ``q`` that arrived after it. The key is computed once per
    ``schedule()`` call (at ``now``) and both queues are sorted with it, which costs
    O(n log n) in the queue lengths per step.

    LoRA (``max_loras`` set): the running requests use at most ``max_loras`` distinct adapters,
    so every one of them stays loaded while it runs. A waiting request whose adapter would be
    one too many is passed over, in place, and the requests behind it are admitted
    (vLLM v1's ``scheduled_loras`` check); it is admitted once a running adapter's requests
    are done, so while requests of the running adapters keep arriving it keeps waiting (as in
    vLLM: no aging across adapters).

    Speculative decoding (vLLM v1's scheduling of ``spec_token_ids``): a running request in
    decode with drafts (``request.spec_token_ids``, set between steps from
    ``spec_decode_candidates``) computes its last token and the drafts in one step, if the
    budget and the pool allow (drafts are cut to the budget and dropped, never preempting
    anyone, when blocks are short). ``update_from_output`` appends the accepted drafts and the
    token sampled after them, and rolls back what was rejected: ``num_computed_tokens`` counts
    only accepted tokens' K/V, blocks that hold only rejected slots are freed, and since block
    keys are computed from ``all_token_ids`` up to ``num_computed_tokens``, no prefix-cache key
    ever includes a rejected token.

    Args:
        kv_cache_manager: owner of the block tables.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: most tokens (prompt + output) of one request.
        policy: ``"fcfs"`` or ``"priority"``.
        priority_aging_interval: seconds of waiting worth one priority level under
            ``priority`` (0: no aging; a low priority can then starve).
        max_loras: most distinct LoRA adapters among running requests (None: LoRA is off).
        num_speculative_tokens: most drafts per request and step (0: no speculative decoding).
        disable_spec_by_batch_size: no drafts in a step when more requests than this are
            running (None: no limit).

    Raises:
        ValueError: an unknown policy or a negative ``priority_aging_interval``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, policy: str = "fcfs",
                 priority_aging_interval: float = 0.0, max_loras: Optional[int] = None,
                 num_speculative_tokens: int = 0, disable_spec_by_batch_size: Optional[int] = None) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if not priority_aging_interval >= 0:
            raise ValueError(f"priority_aging_interval must be >= 0 seconds, got {priority_aging_interval!r}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.priority_aging_interval = priority_aging_interval
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0
        self.num_watermark_blocks = int(WATERMARK * kv_cache_manager.num_blocks)
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_spec_by_batch_size = disable_spec_by_batch_size
        # Running totals (vLLM's spec_decode_num_* counters): steps where a request verified
        # drafts, drafts verified, drafts accepted.
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0

    # ----------------------------------------------------------------------------- queues
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued_seqs(self) -> int:
        """The waiting requests' sequences (``1 + pending forks`` each) beyond the seats free now
        (``max_num_seqs`` less the running sequences): at least this many cannot start in the
        next step, whatever its token budget and free blocks. O(running + waiting)."""
        running = sum(1 + len(r.pending_forks) for r in self.running)
        waiting = sum(1 + len(r.pending_forks) for r in self.waiting)
        return max(0, waiting - max(0, self.max_num_seqs - running))

    def finish_requests(self, request_ids: Iterable[RequestId], status: RequestStatus) -> list[Request]:
        """End requests now (abort): free their blocks and drop them from the queues.

        Unknown or already finished ids are ignored. Returns the requests that were ended.
        """
        ended = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request)
            ended.append(request)
        return ended

    def order_key(self, now: float) -> Callable[[Request], tuple]:
        """The policy's sort key at ``now`` (monotonic seconds): smaller runs first and is
        preempted last (see the class docstring)."""
        if self.policy == "fcfs":
            return lambda request: (request.arrival_time,)
        aging = self.priority_aging_interval

        def key(request: Request) -> tuple:
            priority = request.priority
            if aging:
                priority -= int(max(0.0, now - request.arrival_time) // aging)
            return priority, request.arrival_time
        return key

    # ----------------------------------------------------------------------------- schedule
    def schedule(self, now: Optional[float] = None) -> SchedulerOutput:
        """Pick this step's batch.

        Args:
            now: the time the priority key ages to (monotonic seconds; default: now).
        """
        output = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        key = self.order_key(time.monotonic() if now is None else now)
        if self.policy == "priority":
            # Sorted, the tail of running is vLLM's max() victim and the head of waiting its
            # heap's top.
            self.running.sort(key=key)
            self.waiting = deque(sorted(self.waiting, key=key))

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            assert num_new_tokens > 0, request
            drafts, request.spec_token_ids = request.spec_token_ids[:token_budget - 1], []
            if drafts and num_new_tokens == 1:
                # Drafts only use blocks that are free: never preempt anyone for a guess.
                if self.kv_cache_manager.allocate_slots(request, 1 + len(drafts)):
                    output.scheduled.append((request, 1 + len(drafts)))
                    output.scheduled_spec_decode_tokens[request.request_id] = drafts
                    token_budget -= 1 + len(drafts)
                    index += 1
                    continue
            while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append((request, num_new_tokens))
                token_budget -= num_new_tokens
                index += 1

        # Nobody was preempted this step, so there is room to admit new work.
        num_seats_taken = len(self.running) + sum(len(r.pending_forks) for r in self.running)
        lora_ids = {r.lora_int_id for r in self.running} - {0}
        passed_over: list[Request] = []
        while self.waiting and token_budget > 0 and not output.preempted:
            request = self.waiting[0]
            lora_id = request.lora_int_id
            if self.max_loras is not None and lora_id and lora_id not in lora_ids and len(lora_ids) >= self.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            num_seats = 1 + len(request.pending_forks)
            if num_seats_taken + num_seats > self.max_num_seqs:
                break
            # A waiting request has no blocks (new, or preempted and freed): take the cached
            # prefix first, then compute only what is left (B15).
            computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_cached, token_budget)
            num_blocks_reserved = self._num_blocks_to_admit(request, computed_blocks)
            if self.running and (num_blocks_reserved + self.num_watermark_blocks
                                 > self.kv_cache_manager.block_pool.num_free_blocks):
                break
            if not self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_cached,
                                                        computed_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora_id:
                lora_ids.add(lora_id)
            num_seats_taken += num_seats
            output.scheduled.append((request, num_new_tokens))
            token_budget -= num_new_tokens

        self.waiting.extendleft(reversed(passed_over))
        # Keep the running list in policy order so that the tail is always the preemption victim.
        self.running.sort(key=key)
        output.blocks_to_copy = self.kv_cache_manager.take_pending_copies()
        if self.max_loras is not None:
            output.lora_ids_in_use = frozenset(r.lora_int_id for r in self.running) - {0}
            assert len(output.lora_ids_in_use) <= self.max_loras, output.lora_ids_in_use
        return output

    def _num_blocks_to_admit(self, request: Request, computed_blocks: list) -> int:
        """Free blocks a waiting request takes to hold all its tokens: new ones past its cached
        prefix, plus the cached ones it revives from the free list (ref count 0)."""
        kv = self.kv_cache_manager
        return (max(0, kv.num_blocks_needed(request.num_tokens) - len(computed_blocks))
                + sum(1 for block in computed_blocks if block.ref_count == 0))

    def spec_decode_candidates(self) -> list[tuple[Request, int]]:
        """The running requests that may get drafts for the next step, each with the most
        drafts it may get: none when speculation is off or more than
        ``disable_spec_by_batch_size`` requests run (the step is compute-bound then).

        A request qualifies when it decodes (only its last token is uncomputed), has no
        samples waiting to fork, and its sampling does not depend on the tokens before each
        row: penalties, ``bad_words``, ``structured_outputs`` and an unmet ``min_tokens`` read
        the output so far, which differs for every verified position (those requests simply
        decode one token per step). Its drafts leave room for the token sampled after them
        within ``max_tokens`` and ``max_model_len``.
        """
        if not self.num_speculative_tokens or (self.disable_spec_by_batch_size is not None
                                               and len(self.running) > self.disable_spec_by_batch_size):
            return []
        candidates = []
        for request in self.running:
            params = request.sampling_params
            if (request.num_computed_tokens != request.num_tokens - 1 or request.pending_forks
                    or request.grammar is not None or params.needs_penalties or params.bad_words
                    or len(request.output_token_ids) < params.min_tokens):
                continue
            max_drafts = min(self.num_speculative_tokens,
                             request.max_tokens - len(request.output_token_ids) - 1,
                             self.max_model_len - request.num_tokens - 1)
            if max_drafts > 0:
                candidates.append((request, max_drafts))
        return candidates

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----------------------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[RequestId, int],
                           num_accepted_tokens: Optional[dict[RequestId, int]] = None) -> list[Request]:
        """Advance progress after the model ran; append sampled tokens; finish requests.

        Args:
            scheduler_output: what was scheduled.
            sampled_token_ids: request_id -> new token, for the requests whose scheduled
                chunk reached their last token and for their ``pending_forks``; for a request
                that verified drafts, the token sampled after its accepted ones.
            num_accepted_tokens: request_id -> how many of its drafts (a prefix of them) the
                model accepted (missing: 0).

        Returns:
            The requests that finished in this step (their blocks are already freed).
        """
        finished: list[Request] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for request, num_new_tokens in scheduler_output.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue
            drafts = spec_tokens.get(request.request_id, ())
            # Drafts count as computed once accepted (_append_token), so a rejected one never
            # enters num_computed_tokens or a block key.
            request.num_computed_tokens += num_new_tokens - len(drafts)
            # Its K/V is written now, so its full blocks may be offered to others.
            self.kv_cache_manager.cache_blocks(request)
            if drafts:
                num_accepted = (num_accepted_tokens or {}).get(request.request_id, 0)
                self.spec_decode_num_drafts += 1
                self.spec_decode_num_draft_tokens += len(drafts)
                self.spec_decode_num_accepted_tokens += num_accepted
                for draft_token_id in drafts[:num_accepted]:
                    self._append_token(request, draft_token_id, finished, computed=True)
                    if request.is_finished():
                        break
                else:
                    self._append_token(request, sampled_token_ids[request.request_id], finished)
                if not request.is_finished():
                    self.kv_cache_manager.cache_blocks(request)
                    self.kv_cache_manager.free_blocks_after(request, request.num_tokens)
                continue
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    # It ran only for its prompt logprobs (echo); nothing is generated.
                    finished.extend(self.finish_requests([request.request_id],
                                                         RequestStatus.FINISHED_LENGTH))
                continue
            forks, request.pending_forks = request.pending_forks, []
            for sibling in forks:
                self._fork(request, sibling)
            for sequence in [request, *forks]:
                self._append_token(sequence, sampled_token_ids[sequence.request_id], finished)
        return finished

    def fork_request(self, parent: Request, child: Request, token_id: int) -> list[Request]:
        """Start ``child`` on the running ``parent``'s computed blocks with ``token_id`` as its
        next token: the fork of ``n > 1`` samples, for a child whose tokens equal the parent's
        up to ``parent.num_computed_tokens``. The token passes the usual stop checks.

        Returns:
            ``[child]`` if the token ended it (its blocks are freed then), else ``[]``.
        """
        assert parent.status == RequestStatus.RUNNING and child.num_tokens == parent.num_computed_tokens, child
        self._fork(parent, child)
        finished: list[Request] = []
        self._append_token(child, token_id, finished)
        return finished

    def _fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` (same prompt, not yet scheduled) on the parent's computed blocks."""
        self.kv_cache_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        # After its parent and siblings (same arrival time), before younger requests: the
        # running list stays oldest-first, so the next step's victim is still the youngest
        # (under ``priority`` the next ``schedule()`` sorts it by its key anyway).
        bisect.insort(self.running, child, key=lambda request: request.arrival_time)

    def _append_token(self, request: Request, token_id: int, finished: list[Request],
                      computed: bool = False) -> None:
        """Append a token (``computed``: an accepted draft, whose K/V this step wrote) and end
        the request if it stops it."""
        request.output_token_ids.append(token_id)
        if computed:
            request.num_computed_tokens += 1
        if request.grammar is not None and not request.grammar.accept_token(token_id):
            # Reached when other masks overrode the grammar's (a row whose every token was
            # masked keeps its raw logits), or when llguidance gave up on the grammar: end it
            # rather than emit invalid output.
            logger.warning("request %s: structured output failed (%s): finished with an error",
                           request.request_id, request.grammar.error or f"token {token_id} not allowed")
            status: Optional[RequestStatus] = RequestStatus.FINISHED_ERROR
        else:
            status = self._check_stop(request, token_id)
        if status is not None:
            request.status = status
            self.running.remove(request)
            del self.requests[request.request_id]
            if computed:
                self.kv_cache_manager.cache_blocks(request)
            self.kv_cache_manager.free(request)
            finished.append(request)

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        """EOS (unless ``ignore_eos``) and ``stop_token_ids`` end a request only after
        ``min_tokens`` other tokens (the sampler masks them before); then a complete
        ``structured_outputs`` constraint (``"stop"``, as vLLM); then the length limits.
        Stop strings are matched on the text, by the engine."""
        params = request.sampling_params
        if len(request.output_token_ids) > params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
