"""Scheduling policy, example by example, with exact expectations.

The ``Scheduler`` runs over a real ``KVCacheManager`` (prefix caching off, so that block counts
are exact) with no model and no tensors: a step is ``schedule()``, then a fake sampled token for
every request whose chunk reaches its last token (and for its pending forks), then
``update_from_output``, as ``LLMEngine.step`` does. ``tests/test_core_properties.py`` checks the
invariants over random workloads; this file pins down who runs, with how many tokens, and who is
preempted.
"""

from __future__ import annotations

from typing import Optional

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
TOKEN = 7  # every fake sampled token; no EOS is set, so only max_tokens ends a request


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 64, **policy) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=False)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, **policy)


def make_request(request_id: str, num_prompt_tokens: int, arrival_time: float, max_tokens: int = 16,
                 n: int = 1, priority: int = 0) -> Request:
    """A request of ``num_prompt_tokens`` tokens; with ``n > 1`` its other samples are its
    ``pending_forks`` (ids ``{request_id}.1``, ...), as ``LLMEngine.add_request`` queues them."""
    params = SamplingParams(n=n, max_tokens=max_tokens)
    prompt = list(range(1, num_prompt_tokens + 1))
    first, *forks = [Request(request_id if index == 0 else f"{request_id}.{index}", prompt, params, max_tokens,
                             eos_token_id=None, arrival_time=arrival_time, seed_offset=index,
                             priority=priority)
                     for index in range(n)]
    first.pending_forks = forks
    return first


def step(scheduler: Scheduler, now: Optional[float] = None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake model; returns the schedule and the requests that finished."""
    output = scheduler.schedule(now)
    sampled: dict[str, int] = {}
    for request, num_new_tokens in output.scheduled:
        if request.num_computed_tokens + num_new_tokens == request.num_tokens:
            for sequence in (request, *request.pending_forks):
                sampled[sequence.request_id] = TOKEN
    return output, scheduler.update_from_output(output, sampled)


def scheduled(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(request.request_id, num_new_tokens) for request, num_new_tokens in output.scheduled]


def ids(requests: list[Request]) -> list[str]:
    return [request.request_id for request in requests]


def num_blocks_of(scheduler: Scheduler, request: Request) -> Optional[int]:
    blocks = scheduler.kv_cache_manager.req_to_blocks.get(request.request_id)
    return None if blocks is None else len(blocks)


# ----------------------------------------------------------------------------- token budget
def test_budget_is_shared_in_arrival_order_and_the_last_prompt_is_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b, c = (make_request(name, 4, arrival_time=t) for t, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)

    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 4), ("b", 4), ("c", 2)]
    assert output.total_num_scheduled_tokens == 10
    assert (a.output_token_ids, b.output_token_ids, c.output_token_ids) == ([TOKEN], [TOKEN], [])
    assert c.num_computed_tokens == 2

    # Decodes first, then the rest of c's prompt; c samples once its prompt is computed.
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 1), ("c", 2)]
    assert c.output_token_ids == [TOKEN]


def test_running_requests_can_use_the_whole_budget_and_nothing_is_admitted():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 16, arrival_time=0), make_request("b", 2, arrival_time=1)
    scheduler.add_request(a)
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 8)]

    scheduler.add_request(b)
    output, _ = step(scheduler)  # the rest of a's prompt takes the whole budget
    assert scheduled(output) == [("a", 8)]
    assert ids(scheduler.waiting) == ["b"] and b.status == RequestStatus.WAITING
    assert num_blocks_of(scheduler, b) is None

    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 2)]


# ----------------------------------------------------------------------------- chunked prefill
def test_long_prompt_is_prefilled_in_budget_sized_chunks_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("long", 10, arrival_time=0)
    scheduler.add_request(request)
    chunks, computed, blocks = [], [], []
    for _ in range(4):
        output, _ = step(scheduler)
        chunks.append(scheduled(output))
        computed.append(request.num_computed_tokens)
        blocks.append(num_blocks_of(scheduler, request))
    assert chunks == [[("long", 4)], [("long", 4)], [("long", 2)], [("long", 1)]]
    assert computed == [4, 8, 10, 11]
    # Blocks grow with the computed tokens, never ahead of them.
    assert blocks == [1, 2, 3, 3]
    assert request.output_token_ids == [TOKEN, TOKEN]


def test_decodes_take_their_token_before_a_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    a, b = make_request("a", 2, arrival_time=0), make_request("b", 7, arrival_time=1)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 3)]
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 3)]
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 1)]
    assert b.output_token_ids == [TOKEN]


def test_decode_requests_are_scheduled_before_new_prefills():
    scheduler = make_scheduler()
    old = make_request("old", 5, arrival_time=0)
    scheduler.add_request(old)
    step(scheduler)
    # Even a request that arrived earlier than the running one waits behind it.
    new = make_request("new", 3, arrival_time=-1)
    scheduler.add_request(new)
    output, _ = step(scheduler)
    assert scheduled(output) == [("old", 1), ("new", 3)]
    assert ids(scheduler.running) == ["new", "old"]  # oldest first after the step


# ----------------------------------------------------------------------------- seats
def test_max_num_seqs_limits_running_requests_and_a_finished_one_frees_its_seat():
    scheduler = make_scheduler(max_num_seqs=2)
    a = make_request("a", 3, arrival_time=0, max_tokens=2)
    b = make_request("b", 3, arrival_time=1)
    c = make_request("c", 3, arrival_time=2)
    for request in (a, b, c):
        scheduler.add_request(request)

    output, finished = step(scheduler)
    assert scheduled(output) == [("a", 3), ("b", 3)]
    assert ids(scheduler.running) == ["a", "b"] and ids(scheduler.waiting) == ["c"]
    assert finished == []

    output, finished = step(scheduler)
    assert scheduled(output) == [("a", 1), ("b", 1)]  # c still has no seat
    assert ids(finished) == ["a"] and a.status == RequestStatus.FINISHED_LENGTH

    output, _ = step(scheduler)
    assert scheduled(output) == [("b", 1), ("c", 3)]


def test_a_request_with_pending_forks_needs_a_seat_for_each_sample():
    scheduler = make_scheduler(max_num_seqs=4)
    solo = make_request("solo", 3, arrival_time=0)
    triple = make_request("triple", 3, arrival_time=1, n=3)
    late = make_request("late", 3, arrival_time=2)
    for request in (solo, triple, late):
        scheduler.add_request(request)

    # 1 + 3 seats = 4: late waits, although only two requests run.
    output, _ = step(scheduler)
    assert scheduled(output) == [("solo", 3), ("triple", 3)]
    assert ids(scheduler.waiting) == ["late"]
    # The prompt was computed once; the other two samples forked off it.
    assert ids(scheduler.running) == ["solo", "triple", "triple.1", "triple.2"]
    assert [len(s.output_token_ids) for s in scheduler.running] == [1, 1, 1, 1]
    assert triple.pending_forks == []
    assert scheduler.kv_cache_manager.get_block_ids("triple.1") == scheduler.kv_cache_manager.get_block_ids("triple")

    output, _ = step(scheduler)
    assert scheduled(output) == [("solo", 1), ("triple", 1), ("triple.1", 1), ("triple.2", 1)]
    assert ids(scheduler.waiting) == ["late"]


def test_a_request_with_pending_forks_waits_until_all_its_seats_are_free():
    scheduler = make_scheduler(max_num_seqs=3)
    a = make_request("a", 3, arrival_time=0, max_tokens=1)
    b = make_request("b", 3, arrival_time=1)
    pair = make_request("pair", 3, arrival_time=2, n=2)
    for request in (a, b, pair):
        scheduler.add_request(request)
    output, finished = step(scheduler)
    assert scheduled(output) == [("a", 3), ("b", 3)]  # 2 + 2 seats > 3
    assert ids(finished) == ["a"]
    output, _ = step(scheduler)
    assert scheduled(output) == [("b", 1), ("pair", 3)]
    assert ids(scheduler.running) == ["b", "pair", "pair.1"]


# ----------------------------------------------------------------------------- preemption
def test_preemption_takes_the_most_recent_request_and_it_resumes_by_recompute():
    # 4 blocks of 4 tokens: three 4-token prompts take 3; their first decode needs 3 more.
    scheduler = make_scheduler(num_blocks=4)
    a = make_request("a", 4, arrival_time=0, max_tokens=2)
    b = make_request("b", 4, arrival_time=1)
    c = make_request("c", 4, arrival_time=2)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    assert [r.num_computed_tokens for r in (a, b, c)] == [4, 4, 4]

    output, finished = step(scheduler)
    # a takes the last free block; b needs one: c, the youngest, gives its block back.
    assert scheduled(output) == [("a", 1), ("b", 1)]
    assert ids(output.preempted) == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert num_blocks_of(scheduler, c) is None
    assert c.output_token_ids == [TOKEN]  # kept: recompute covers prompt and output
    assert ids(finished) == ["a"]  # a's 2 blocks are free again
    assert ids(scheduler.waiting) == ["c"] and ids(scheduler.running) == ["b"]

    # c comes back first of the waiting, recomputes its prompt and its generated token, and
    # samples where it stopped.
    late = make_request("late", 1, arrival_time=3)
    scheduler.add_request(late)
    output, _ = step(scheduler)
    assert scheduled(output) == [("b", 1), ("c", 5)]
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 5
    assert c.output_token_ids == [TOKEN, TOKEN]
    assert ids(scheduler.waiting) == ["late"]  # 0 blocks free: no room for late


def test_a_preempted_request_goes_back_in_front_of_older_waiting_requests():
    scheduler = make_scheduler(num_blocks=3, max_num_seqs=2)
    a, b = make_request("a", 4, arrival_time=0), make_request("b", 4, arrival_time=1)
    waiting = make_request("waiting", 1, arrival_time=-1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    scheduler.add_request(waiting)  # no seat: max_num_seqs=2
    output, _ = step(scheduler)  # a takes the free block, b has none left
    assert ids(output.preempted) == ["b"]
    assert ids(scheduler.waiting) == ["b", "waiting"]


def test_a_request_is_admitted_beside_others_only_when_its_whole_prompt_fits():
    """8 blocks of 4 tokens, 12 tokens a step. a (16 tokens) holds 4 blocks after step 2; b
    (20 tokens, 5 blocks) would fit its first 8-token chunk in the 4 free blocks, but not its
    whole prompt: admitted on its first chunk, it would run out of blocks at its next chunk
    (a's decode needs a 5th block) and be preempted by recompute. It waits for a instead."""
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=12)
    a = make_request("a", 16, arrival_time=0, max_tokens=3)
    b = make_request("b", 20, arrival_time=1, max_tokens=2)
    scheduler.add_request(a)
    assert scheduled(step(scheduler)[0]) == [("a", 12)]
    scheduler.add_request(b)
    assert scheduled(step(scheduler)[0]) == [("a", 4)]
    assert ids(scheduler.waiting) == ["b"] and scheduler.kv_cache_manager.block_pool.num_free_blocks == 4
    assert scheduled(step(scheduler)[0]) == [("a", 1)]
    output, finished = step(scheduler)
    assert scheduled(output) == [("a", 1)] and ids(finished) == ["a"]
    # a's blocks are free: b is admitted alone, on its first chunk.
    assert scheduled(step(scheduler)[0]) == [("b", 12)]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.num_preemptions == 0
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 8


def test_nothing_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=3)
    a, b = make_request("a", 4, arrival_time=0), make_request("b", 4, arrival_time=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    # b is preempted for a's block; c would fit in the block b gave back, but waits a step.
    scheduler.add_request(make_request("c", 1, arrival_time=2))
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 1)] and ids(output.preempted) == ["b"]
    assert ids(scheduler.waiting) == ["b", "c"]


def test_a_request_preempts_itself_when_it_is_the_most_recent():
    scheduler = make_scheduler(num_blocks=5)
    a, b, c = (make_request(name, 4, arrival_time=t) for t, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    output, _ = step(scheduler)  # a and b take the 2 free blocks; c finds none
    assert scheduled(output) == [("a", 1), ("b", 1)]
    assert ids(output.preempted) == ["c"]
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 4


def test_several_victims_in_one_step_youngest_first():
    # a, b and c hold a block each; a's 12-token chunk then needs 3 more blocks, 1 is free.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=16)
    a = make_request("a", 4, arrival_time=0)
    b = make_request("b", 4, arrival_time=1)
    c = make_request("c", 4, arrival_time=2)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    a.output_token_ids += [TOKEN] * 11  # 16 tokens, 4 computed: 12 to compute, 4 blocks in all
    output, _ = step(scheduler)
    assert scheduled(output) == [("a", 12)]
    assert ids(output.preempted) == ["c", "b"]
    assert ids(scheduler.waiting) == ["b", "c"]


def test_forks_keep_their_place_in_arrival_order_for_preemption():
    """A fork has its parent's arrival time, so a younger request is preempted before it."""
    # parent + fork share the parent's prompt block, young has its own: 2 of 4 blocks used;
    # the next decode needs 3 new blocks (the forks' tokens 4.. go into blocks of their own).
    scheduler = make_scheduler(num_blocks=4)
    parent = make_request("parent", 4, arrival_time=0, n=2)
    young = make_request("young", 4, arrival_time=1)
    scheduler.add_request(parent)
    scheduler.add_request(young)
    step(scheduler)
    assert ids(scheduler.running) == ["parent", "parent.1", "young"]

    output, _ = step(scheduler)
    assert scheduled(output) == [("parent", 1), ("parent.1", 1)]
    assert ids(output.preempted) == ["young"]


# ----------------------------------------------------------------------------- finishing
def test_a_finished_request_frees_its_blocks_at_once():
    scheduler = make_scheduler(num_blocks=8)
    pool = scheduler.kv_cache_manager.block_pool
    short = make_request("short", 6, arrival_time=0, max_tokens=3)
    other = make_request("other", 4, arrival_time=1)
    scheduler.add_request(short)
    scheduler.add_request(other)
    step(scheduler)
    step(scheduler)
    assert pool.num_used_blocks == 2 + 2
    output, finished = step(scheduler)
    assert ids(finished) == ["short"] and short.status == RequestStatus.FINISHED_LENGTH
    assert short.output_token_ids == [TOKEN] * 3
    assert num_blocks_of(scheduler, short) is None
    assert pool.num_used_blocks == 2  # other's
    assert ids(scheduler.running) == ["other"] and "short" not in scheduler.requests
    pool.check_invariants()


def test_max_model_len_ends_a_request_before_max_tokens():
    scheduler = make_scheduler(max_model_len=6)
    request = make_request("r", 4, arrival_time=0, max_tokens=16)
    scheduler.add_request(request)
    _, finished = step(scheduler)
    assert finished == []
    _, finished = step(scheduler)
    assert ids(finished) == ["r"] and request.num_tokens == 6
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


# ----------------------------------------------------------------------------- priority policy
def test_priority_admits_lower_values_first_and_ties_by_arrival():
    scheduler = make_scheduler(max_num_seqs=2, policy="priority")
    for name, priority, arrival in (("a", 1, 0), ("b", 0, 1), ("c", 0, 2), ("d", -1, 3)):
        scheduler.add_request(make_request(name, 4, arrival_time=arrival, max_tokens=1, priority=priority))
    output, finished = step(scheduler, now=4)
    assert scheduled(output) == [("d", 4), ("b", 4)]
    assert ids(finished) == ["d", "b"]
    output, _ = step(scheduler, now=5)
    assert scheduled(output) == [("c", 4), ("a", 4)]


def test_fcfs_ignores_priorities():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("old", 4, arrival_time=0, priority=5))
    scheduler.add_request(make_request("urgent", 4, arrival_time=1, priority=-5))
    output, _ = step(scheduler)
    assert scheduled(output) == [("old", 4)]


def test_priority_preempts_the_lowest_priority_running_request_not_the_youngest():
    # As the FCFS preemption test, but the oldest request has the lowest priority (largest
    # value): it is the victim, where FCFS would take c.
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    a = make_request("a", 4, arrival_time=0, priority=5)
    b = make_request("b", 4, arrival_time=1, priority=0, max_tokens=2)
    c = make_request("c", 4, arrival_time=2, priority=0)
    for request in (a, b, c):
        scheduler.add_request(request)
    output, _ = step(scheduler, now=3)
    assert scheduled(output) == [("b", 4), ("c", 4), ("a", 4)]  # budget taken in priority order
    output, finished = step(scheduler, now=4)
    # b takes the last free block; c needs one: a, priority 5, gives its block back.
    assert scheduled(output) == [("b", 1), ("c", 1)]
    assert ids(output.preempted) == ["a"] and a.status == RequestStatus.PREEMPTED
    assert ids(finished) == ["b"]
    assert ids(scheduler.waiting) == ["a"] and ids(scheduler.running) == ["c"]
    scheduler.kv_cache_manager.block_pool.check_invariants()


def test_priority_ties_preempt_the_latest_arrival():
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    a, b, c = (make_request(name, 4, arrival_time=t, priority=1) for t, name in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler, now=3)
    output, _ = step(scheduler, now=4)
    assert ids(output.preempted) == ["c"]


def test_a_preempted_low_priority_request_waits_behind_higher_priority_ones():
    scheduler = make_scheduler(num_blocks=3, max_num_seqs=2, policy="priority")
    low = make_request("low", 4, arrival_time=0, priority=3)
    high = make_request("high", 4, arrival_time=1, priority=0, max_tokens=1)
    scheduler.add_request(low)
    scheduler.add_request(high)
    step(scheduler, now=2)  # high finishes its one token
    scheduler.add_request(make_request("mid", 4, arrival_time=2, priority=1))
    scheduler.add_request(make_request("new_high", 4, arrival_time=3, priority=0))
    output, _ = step(scheduler, now=4)
    assert scheduled(output)[0] == ("low", 1)
    assert scheduled(output)[1:] == [("new_high", 4)]  # ahead of mid (priority 1)
    output, _ = step(scheduler, now=5)  # new_high decodes, low needs a block: low is the victim
    assert ids(output.preempted) == ["low"]
    assert ids(scheduler.waiting) == ["low", "mid"]
    output, _ = step(scheduler, now=6)
    assert [request_id for request_id, _ in scheduled(output)] == ["new_high", "mid"]


def test_aging_bounds_starvation():
    """priority_aging_interval=10: after 30 s a priority-3 request ranks as priority 0 and,
    having arrived first, goes before priority-0 requests that arrived later."""
    def first_admitted(now: float) -> str:
        scheduler = make_scheduler(max_num_seqs=1, policy="priority", priority_aging_interval=10.0)
        scheduler.add_request(make_request("patient", 4, arrival_time=0, priority=3))
        scheduler.add_request(make_request("urgent", 4, arrival_time=25, priority=0))
        output, _ = step(scheduler, now=now)
        return scheduled(output)[0][0]

    assert first_admitted(now=29.9) == "urgent"  # patient's effective priority: 3 - 2 = 1
    assert first_admitted(now=30.0) == "patient"  # 3 - 3 = 0, and it arrived first


def test_unknown_policy_and_negative_aging_are_refused():
    kv = KVCacheManager(8, BLOCK_SIZE, enable_caching=False)
    with pytest.raises(ValueError, match="scheduling_policy must be one of .* got 'lifo'"):
        Scheduler(kv, 2, 16, 16, policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_interval must be >= 0 seconds, got -1"):
        Scheduler(kv, 2, 16, 16, policy="priority", priority_aging_interval=-1)


def test_token_ids_between_equals_the_slice_of_all_token_ids():
    """Every [start, end) over a prompt and an output: inside either, and across the border."""
    request = Request("r", [10, 11, 12, 13], SamplingParams(), max_tokens=8, eos_token_id=None)
    request.output_token_ids = [20, 21, 22]
    for start in range(request.num_tokens + 1):
        for end in range(start, request.num_tokens + 1):
            assert request.token_ids_between(start, end) == request.all_token_ids[start:end], (start, end)
