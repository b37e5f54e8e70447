"""Property-based test of the KV-cache core: ``BlockPool`` + ``KVCacheManager`` + ``Scheduler``.

A ``hypothesis`` state machine drives the three classes directly, with no model and no tensors,
the way ``LLMEngine`` and ``beam_search`` drive them:

- ``add_request``: ``LLMEngine.add_request``'s admission checks, then the first sample of an
  ``n > 1`` request is queued with the others as its ``pending_forks`` (``max_tokens=0`` with
  prompt logprobs: echo only);
- ``step``: ``LLMEngine.step``: ``schedule()``, the model runner's part (copy-on-write copies,
  then the K/V writes, then a fake sampled token for every request whose chunk reached its last
  token and for its pending forks), ``update_from_output``, and stop strings ending requests;
- ``abort``: ``LLMEngine.abort_request`` on a waiting or running request;
- ``beam_*``: ``beam_search``'s use of the manager (fork the extended beams, free the others,
  copy-on-write when a beam writes into a block it still shares), next to the scheduler's
  requests in the same pool;
- ``reset_prefix_cache``.

Pools are tiny (4-12 blocks of 1, 2 or 4 tokens), prompts start with one of a few shared
prefixes over an 8-token vocabulary, and half the runs use a hash function that collides on
purpose, so preemption, prefix-cache hits, evictions, collisions and copy-on-write all happen
within a few steps; ``target`` steers generation towards runs with many preemptions and copies.
Runs are derandomized and keep no example database, so CI always runs the same examples.

Besides the block accounting, the test keeps a shadow of what each physical block holds
(``contents``): the K/V of position ``p`` depends on the tokens ``[0, p]``, so a step writes that
prefix where the model would write the K/V, and copy-on-write copies the shadow. Every table must
then read back its own request's prefixes, which is what a wrong prefix-cache hit (even one with
the right token ids at another position), a bad fork or a missed copy would break.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from typing import Callable, Optional

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings, target
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

VOCAB = 8
# Not 0 or VOCAB - 1: hypothesis draws the ends of a range often, and requests would stop at once.
EOS = 5
STOP_TOKEN = 4
# Prompts start with a prefix of one of these, so that requests share full blocks.
PREFIXES = ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [2] * 12, [5, 4, 3, 2, 1, 0] * 2)
MAX_BEAM_GROUPS = 2
MAX_DRAIN_STEPS = 2_000


def colliding_hash(key: tuple) -> int:
    """A deterministic block hash with two values: most different blocks collide."""
    return zlib.crc32(repr(key).encode()) & 1


tokens = st.integers(0, VOCAB - 1)
prompts = st.builds(lambda prefix, length, suffix: prefix[:length] + suffix,
                    st.sampled_from(PREFIXES), st.integers(0, 12), st.lists(tokens, max_size=4))
request_specs = st.fixed_dictionaries({
    "prompt": prompts,
    "max_tokens": st.integers(0, 8),
    "n": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "stop_token": st.booleans(),
    "prompt_logprobs": st.booleans(),
    "cache_salt": st.sampled_from([None, None, "salt"]),
})


class CoreStateMachine(RuleBasedStateMachine):
    """The engine's use of the core, one operation per rule, invariants after each."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: Optional[KVCacheManager] = None

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([2, 4, 1]),
                max_num_seqs=st.integers(1, 4), max_num_batched_tokens=st.integers(1, 16),
                enable_caching=st.booleans(), collide=st.booleans())
    def build(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
              enable_caching: bool, collide: bool) -> None:
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching,
                                 hash_fn=colliding_hash if collide else hash)
        self.pool = self.kv.block_pool
        # As LLMEngine: max_model_len defaults to the pool's capacity.
        self.max_model_len = num_blocks * block_size
        self.max_num_seqs = max_num_seqs
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        # request id of the user request -> its samples (LLMEngine.parents), while any runs.
        self.parents: dict[str, list[Request]] = {}
        # every sequence ever created, by id (LLMEngine's requests of a step)
        self.sequences: dict[str, Request] = {}
        # beam group id -> [running beams, tokens it may still generate]
        self.beam_groups: dict[int, list] = {}
        # block id -> per slot, the tokens its K/V was computed from (the prefix up to that slot)
        self.contents: list[list[Optional[tuple[int, ...]]]] = [[None] * block_size for _ in range(num_blocks)]
        self._ids = itertools.count()
        self._clock = itertools.count()

    # ----------------------------------------------------------------------------- the model runner
    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.contents[dst] = list(self.contents[src])

    def _write_kv(self, batch: list[tuple[Request, int]]) -> None:
        """Write the scheduled tokens' "K/V" into their slots, as the forward does."""
        for request, num_new in batch:
            token_ids = tuple(request.all_token_ids)
            table = self.kv.req_to_blocks[request.request_id]
            assert len(table) * self.block_size >= request.num_computed_tokens + num_new, \
                f"{request} was scheduled {num_new} tokens beyond its block table"
            for position in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
                block = table[position // self.block_size]
                assert block.ref_count == 1, f"{request} writes into {block}, still shared (missed copy-on-write)"
                assert block.cache_id is None, f"{request} writes into cached {block}"
                self.contents[block.block_id][position % self.block_size] = token_ids[:position + 1]

    def _step(self, sample: Callable[[Request], int], stop_string: Callable[[Request], bool]) -> SchedulerOutput:
        """One ``LLMEngine.step()``: schedule, run the fake model, update, stop strings."""
        output = self.scheduler.schedule()
        assert output.total_num_scheduled_tokens <= self.scheduler.max_num_batched_tokens
        scheduled_ids = [request.request_id for request, _ in output.scheduled]
        assert len(set(scheduled_ids)) == len(scheduled_ids), scheduled_ids
        for request, num_new in output.scheduled:
            # At least one token: the last one's logits are what a sample needs.
            assert request.status == RequestStatus.RUNNING and num_new > 0, (request, num_new)
            assert request.num_computed_tokens + num_new <= request.num_tokens, (request, num_new)
        for request in output.preempted:
            assert request.status == RequestStatus.PREEMPTED and request.request_id not in self.kv.req_to_blocks
        if output.is_empty:
            return output
        self._apply_copies(output.blocks_to_copy)
        self._write_kv(output.scheduled)
        sampled: dict[str, int] = {}
        for request, num_new in output.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            if end == request.num_tokens and request.max_tokens > 0:
                for sequence in (request, *request.pending_forks):
                    sampled[sequence.request_id] = sample(sequence)
            if request.sampling_params.prompt_logprobs is not None:
                first = max(start + 1, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                request.prompt_logprobs.extend([None] * max(0, last - first + 1))
        self.scheduler.update_from_output(output, sampled)
        for request_id in sampled:
            request = self.sequences[request_id]
            if stop_string(request):
                if request.is_finished():
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)
        self._forget_finished_parents()
        return output

    def _forget_finished_parents(self) -> None:
        for parent_id in [p for p, children in self.parents.items() if all(c.is_finished() for c in children)]:
            del self.parents[parent_id]

    # ----------------------------------------------------------------------------- engine rules
    @precondition(lambda self: self.kv is not None)
    @rule(spec=request_specs)
    def add_request(self, spec: dict) -> None:
        """``LLMEngine.add_request``: its admission checks, then ``n`` samples, the first queued."""
        # Cut to what this pool can take, so that most drawn requests are admitted.
        prompt = (spec["prompt"] or [0])[:self.max_model_len - 1]
        max_tokens = min(spec["max_tokens"], self.max_model_len - len(prompt))
        n = min(spec["n"], self.max_num_seqs)
        num_prompt = len(prompt)
        per_sample = cdiv(num_prompt + max_tokens, self.block_size)
        shared = num_prompt // self.block_size
        if (num_prompt + 1 > self.max_model_len or num_prompt + max_tokens > self.max_model_len
                or n > self.max_num_seqs or shared + (per_sample - shared) * n > self.pool.num_blocks):
            return  # LLMEngine raises ValueError; nothing is queued
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=spec["ignore_eos"],
                                min_tokens=min(spec["min_tokens"], max_tokens),
                                stop_token_ids=[STOP_TOKEN] if spec["stop_token"] else None,
                                prompt_logprobs=0 if spec["prompt_logprobs"] else None)
        parent_id = f"r{next(self._ids)}"
        arrival_time = float(next(self._clock))
        children = [Request(parent_id if n == 1 else f"{index}_{parent_id}", prompt, params, max_tokens, EOS,
                            arrival_time, seed_offset=index, cache_salt=spec["cache_salt"])
                    for index in range(n)]
        self.sequences.update((child.request_id, child) for child in children)
        if max_tokens == 0:
            for child in children[1:] if params.prompt_logprobs is not None else children:
                child.status = RequestStatus.FINISHED_LENGTH
        if children[0].is_finished():
            return
        if max_tokens > 0:
            children[0].pending_forks = children[1:]
        self.parents[parent_id] = children
        self.scheduler.add_request(children[0])

    @precondition(lambda self: self.kv is not None and self.scheduler.has_unfinished_requests())
    @rule(num_steps=st.integers(1, 10), data=st.data())
    def step(self, num_steps: int, data: st.DataObject) -> None:
        """``LLMEngine.step``, a few times in a row (invariants checked after each), with sampled
        token ids drawn at random (EOS and the stop token included) and, now and then, a stop
        string matched in the text."""
        for _ in range(num_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step(lambda request: data.draw(tokens, label=f"token of {request.request_id}"),
                       lambda request: data.draw(st.integers(0, 9), label="stop string") == 5)
            self.core_invariants_hold()

    @precondition(lambda self: self.kv is not None and self.parents)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """``LLMEngine.abort_request``: every sample of a request, waiting, running or forked."""
        parent_id = data.draw(st.sampled_from(sorted(self.parents)), label="abort")
        children = self.parents.pop(parent_id)
        self.scheduler.finish_requests([c.request_id for c in children], RequestStatus.FINISHED_ABORTED)
        for child in children:
            if not child.is_finished():
                child.status = RequestStatus.FINISHED_ABORTED

    @precondition(lambda self: self.kv is not None and self.pool._cached)
    @rule()
    def reset_prefix_cache(self) -> None:
        """``LLMEngine.reset_prefix_cache``, with blocks cached (in use or free)."""
        self.kv.reset_prefix_cache()

    # ----------------------------------------------------------------------------- beam search
    def _new_beam(self, prompt: list[int], output_token_ids: list[int]) -> Request:
        beam = Request(f"beam-{next(self._ids)}", prompt, SamplingParams(temperature=0.0), 1, EOS)
        beam.output_token_ids = list(output_token_ids)
        self.sequences[beam.request_id] = beam
        return beam

    def _end_beam_group(self, group_id: int) -> None:
        """``_BeamSearch.run``'s ``finally``: free every running beam."""
        for beam in self.beam_groups.pop(group_id)[0]:
            self.kv.free(beam)

    def _compute_beams(self, group_id: int) -> bool:
        """``_BeamSearch._compute``: admit new beams through the prefix cache, then compute every
        uncomputed token in batches within the token budget. False if the pool ran out (beam
        search raises then, and its ``finally`` frees the beams)."""
        beams = self.beam_groups[group_id][0]
        for beam in beams:
            if beam.num_computed_tokens == 0 and beam.request_id not in self.kv.req_to_blocks:
                blocks, num_cached = self.kv.get_computed_blocks(beam)
                if not self.kv.allocate_slots(beam, 0, num_cached, blocks):
                    return False
                beam.num_computed_tokens = num_cached
        pending = [beam for beam in beams if beam.num_computed_tokens < beam.num_tokens]
        while pending:
            batch, left = [], self.scheduler.max_num_batched_tokens
            for beam in pending:
                if left == 0:
                    break
                num_new = min(beam.num_tokens - beam.num_computed_tokens, left)
                if not self.kv.allocate_slots(beam, num_new):
                    return False
                batch.append((beam, num_new))
                left -= num_new
            self._apply_copies(self.kv.take_pending_copies())
            self._write_kv(batch)
            for beam, num_new in batch:
                beam.num_computed_tokens += num_new
                self.kv.cache_blocks(beam)
            pending = [beam for beam in pending if beam.num_computed_tokens < beam.num_tokens]
        return True

    @precondition(lambda self: self.kv is not None and len(self.beam_groups) < MAX_BEAM_GROUPS)
    @rule(prompt=prompts, max_tokens=st.integers(1, 4))
    def beam_start(self, prompt: list[int], max_tokens: int) -> None:
        """A beam search begins with one beam on the prompt, computed at once."""
        prompt = prompt or [0]
        if len(prompt) + max_tokens > self.max_model_len:
            return  # beam_search raises ValueError
        group_id = next(self._ids)
        self.beam_groups[group_id] = [[self._new_beam(prompt, [])], max_tokens]
        if not self._compute_beams(group_id):
            self._end_beam_group(group_id)

    @precondition(lambda self: self.kv is not None and self.beam_groups)
    @rule(data=st.data())
    def beam_step(self, data: st.DataObject) -> None:
        """One beam-search step: compute the beams, extend some (a fork each, several forks of
        one beam being siblings that share its blocks), free the old beams."""
        group_id = data.draw(st.sampled_from(sorted(self.beam_groups)), label="beam group")
        beams, tokens_left = self.beam_groups[group_id]
        if not self._compute_beams(group_id):
            self._end_beam_group(group_id)
            return
        extensions = data.draw(st.lists(st.tuples(st.integers(0, len(beams) - 1), tokens), max_size=3),
                               label="extensions")
        extended = []
        for beam_index, token in extensions:
            parent = beams[beam_index]
            child = self._new_beam(parent.prompt_token_ids, parent.output_token_ids + [token])
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            extended.append(child)
        for beam in beams:
            self.kv.free(beam)
        self.beam_groups[group_id] = [extended, tokens_left - 1]
        if not extended or tokens_left == 1:
            self._end_beam_group(group_id)

    @precondition(lambda self: self.kv is not None and self.beam_groups)
    @rule(data=st.data())
    def beam_end(self, data: st.DataObject) -> None:
        """A beam search stops early (all hypotheses finished)."""
        self._end_beam_group(data.draw(st.sampled_from(sorted(self.beam_groups)), label="beam group"))

    # ----------------------------------------------------------------------------- invariants
    # Each check is named after what it guards; ``core_invariants_hold`` runs them all.
    def _live_sequences(self) -> dict[str, Request]:
        """Sequences that may hold blocks: the scheduler's running requests and the beams."""
        live = {request.request_id: request for request in self.scheduler.running}
        for beams, _ in self.beam_groups.values():
            live.update((beam.request_id, beam) for beam in beams)
        return live

    def free_plus_in_use_is_total(self) -> None:
        """Every block is either free (empty or cached-free) or in use, never both or neither;
        also the pool's own ``check_invariants``."""
        in_use = sum(1 for block in self.pool.blocks if block.ref_count > 0)
        assert len(self.pool.free_block_ids()) + in_use == self.pool.num_blocks
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        self.pool.check_invariants()

    def stats_add_up(self) -> None:
        """``get_stats`` (what metrics and ``/load`` read) counts every block once and every
        in-use slot as stored or empty."""
        stats = self.kv.get_stats()
        assert stats.num_used_blocks + stats.num_cached_free_blocks + stats.num_empty_free_blocks == stats.num_blocks
        assert stats.num_shared_blocks == sum(1 for block in self.pool.blocks if block.ref_count > 1)
        assert stats.num_stored_tokens >= 0 and stats.num_empty_slots >= 0
        assert stats.num_stored_tokens + stats.num_empty_slots == stats.num_used_blocks * self.block_size
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries

    def no_referenced_block_is_free(self) -> None:
        """A block with ``ref_count > 0`` is never on the free queue (allocate would hand it to a
        second owner), and every free block has ``ref_count == 0``."""
        for block_id in self.pool.free_block_ids():
            assert self.pool.blocks[block_id].ref_count == 0, self.pool.blocks[block_id]

    def ref_counts_equal_table_holders(self) -> None:
        """A block's ``ref_count`` is the number of block tables holding it (a leak if larger, a
        double free or early reuse if smaller); a table never holds one block twice."""
        holders: Counter[int] = Counter()
        for request_id, table in self.kv.req_to_blocks.items():
            ids = [block.block_id for block in table]
            assert len(set(ids)) == len(ids), f"{request_id} holds a block twice: {ids}"
            for block in table:
                assert self.pool.blocks[block.block_id] is block
            holders.update(ids)
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])

    def no_freed_block_stays_in_a_table(self) -> None:
        """Only live sequences have block tables: a finished, aborted, preempted or waiting
        request has none, so no block it gave back can still be read or written through it."""
        live = self._live_sequences()
        assert set(self.kv.req_to_blocks) == set(live), (sorted(self.kv.req_to_blocks), sorted(live))
        assert set(self.kv._requests) == set(live)
        for table in self.kv.req_to_blocks.values():
            for block in table:
                assert block.ref_count > 0 and block.block_id not in self.pool.free_block_ids(), block

    def tables_cover_computed_tokens(self) -> None:
        """Between steps a sequence's table holds exactly the blocks of its computed tokens:
        none missing (K/V would be lost) and none reserved beyond them."""
        for request_id, table in self.kv.req_to_blocks.items():
            request = self.kv._requests[request_id]
            assert len(table) == cdiv(request.num_computed_tokens, self.block_size), (request, len(table))

    def tables_read_back_their_tokens(self) -> None:
        """Through its block table, every computed position of a sequence holds K/V computed
        from that sequence's own tokens up to it: what a wrong prefix-cache hit, a bad fork or a
        missed copy-on-write breaks."""
        for request_id, table in self.kv.req_to_blocks.items():
            request = self.kv._requests[request_id]
            token_ids = tuple(request.all_token_ids)
            for position in range(request.num_computed_tokens):
                block = table[position // self.block_size]
                held = self.contents[block.block_id][position % self.block_size]
                assert held == token_ids[:position + 1], (request, position, block, held)

    def cached_blocks_hold_what_their_key_names(self) -> None:
        """A block in the prefix cache (in use or cached-free) holds the K/V of exactly the
        tokens its key names, right after what its parent block holds (a first block: at the
        start of a sequence), so that a hit returns the right K/V."""
        by_cache_id = {block.cache_id: block for block in self.pool.blocks if block.cache_id is not None}
        for block in by_cache_id.values():
            slots = self.contents[block.block_id]
            assert all(slot is not None for slot in slots), block
            assert tuple(slot[-1] for slot in slots) == block.block_hash.token_ids, (block, slots)
            if block.parent_cache_id is None:
                assert len(slots[0]) == 1, (block, slots)
            elif block.parent_cache_id in by_cache_id:
                assert slots[0][:-1] == self.contents[by_cache_id[block.parent_cache_id].block_id][-1], block

    def scheduler_queues_are_consistent(self) -> None:
        """Each unfinished request is in exactly one queue with the matching status; waiting ones
        have computed nothing; running sequences plus reserved fork seats fit ``max_num_seqs``."""
        running = {request.request_id for request in self.scheduler.running}
        waiting = {request.request_id for request in self.scheduler.waiting}
        assert len(running) == len(self.scheduler.running) and len(waiting) == len(self.scheduler.waiting)
        assert not running & waiting and running | waiting == set(self.scheduler.requests)
        for request in self.scheduler.running:
            assert request.status == RequestStatus.RUNNING, request
        for request in self.scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
        seats = len(self.scheduler.running) + sum(len(r.pending_forks) for r in self.scheduler.running)
        assert seats <= self.max_num_seqs

    def all_blocks_back_when_idle(self) -> None:
        """When every request has ended and no beam search runs, every block is back (free or
        cached-free, ref count 0) and the manager keeps no per-request state."""
        if self.parents or self.beam_groups:
            return
        assert not self.scheduler.has_unfinished_requests() and not self.scheduler.requests
        assert all(block.ref_count == 0 for block in self.pool.blocks)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert not self.kv.req_to_blocks and not self.kv._requests
        assert not self.kv._block_hashes and not self.kv._num_cached_blocks
        assert not self.kv._pending_copies

    @precondition(lambda self: self.kv is not None)
    @invariant()
    def core_invariants_hold(self) -> None:
        """Every check above, after every rule (and after every step of ``step``)."""
        for check in (self.free_plus_in_use_is_total, self.stats_add_up, self.no_referenced_block_is_free,
                      self.ref_counts_equal_table_holders, self.no_freed_block_stays_in_a_table,
                      self.tables_cover_computed_tokens, self.tables_read_back_their_tokens,
                      self.cached_blocks_hold_what_their_key_names, self.scheduler_queues_are_consistent,
                      self.all_blocks_back_when_idle):
            check()

    def teardown(self) -> None:
        """Run what is left to the end (beams stop, requests generate a non-stop token until
        their length limit): the scheduler must finish everything, and every block comes back."""
        if self.kv is None:
            return
        # Steer generation towards runs that preempt and copy (both are rare by chance).
        target(float(self.scheduler.num_preemptions), label="preemptions")
        target(float(self.kv.num_copies), label="copy-on-write copies")
        for group_id in sorted(self.beam_groups):
            self._end_beam_group(group_id)
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step(lambda request: 1, lambda request: False)
            self.core_invariants_hold()
        else:
            raise AssertionError(f"no progress after {MAX_DRAIN_STEPS} steps: {self.scheduler.running} "
                                 f"running, {list(self.scheduler.waiting)} waiting")
        self._forget_finished_parents()
        assert not self.parents, self.parents
        self.core_invariants_hold()


CoreStateMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], print_blob=False)
test_core_state_machine = CoreStateMachine.TestCase
