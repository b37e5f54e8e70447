"""Prefix caching on a tiny random llama: hits, eviction, collisions, salts, accounting.

The reference for every output is the same engine with ``enable_prefix_caching=False`` (or the
request run alone), which computes every token.
"""

from __future__ import annotations

import logging
import random

from pagedllm import SamplingParams
from pagedllm.core.block_pool import BlockHash, BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from tests.conftest import TINY_VOCAB, make_tiny_engine, run_to_completion

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
BLOCK = 4  # make_tiny_engine's block size


def tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(length)]


def run(engine, prompts: dict[str, list[int]], params=GREEDY, **add_kwargs) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params, **add_kwargs)
    finals = run_to_completion(engine)
    engine.kv_cache_manager.block_pool.check_invariants()
    return finals


def token_ids(finals: dict) -> dict[str, list[int]]:
    return {request_id: output.outputs[0].token_ids for request_id, output in finals.items()}


def test_greedy_identical_with_prefix_caching_on_and_off():
    rng = random.Random(0)
    system = tokens(rng, 41)
    # Wave 1: eight first-time requests sharing 41 tokens, all admitted in the same step, so
    # none can hit the others' blocks (they are not written yet). Wave 2 repeats the prefix.
    # Wave 3 runs unrelated prompts through a small pool, evicting wave 1's blocks, then
    # wave 4 asks for the prefix again.
    waves = [{f"w1-{i}": system + tokens(rng, rng.randint(1, 9)) for i in range(8)},
             {f"w2-{i}": system + tokens(rng, rng.randint(1, 9)) for i in range(4)},
             {f"w3-{i}": tokens(rng, 60) for i in range(8)},
             {f"w4-{i}": system + tokens(rng, rng.randint(1, 9)) for i in range(2)}]
    kwargs = dict(num_gpu_blocks_override=128, max_num_batched_tokens=512, max_num_seqs=8)
    cached = make_tiny_engine(**kwargs)
    plain = make_tiny_engine(enable_prefix_caching=False, **kwargs)
    for wave in waves:
        with_cache = run(cached, wave)
        without = run(plain, wave)
        assert token_ids(with_cache) == token_ids(without)
        hits = {request_id: output.num_cached_tokens for request_id, output in with_cache.items()}
        if wave is waves[0]:
            assert set(hits.values()) == {0}
        elif wave is waves[1]:
            assert set(hits.values()) == {40}  # 10 full blocks of the 41-token prefix
        assert all(output.num_cached_tokens == 0 for output in without.values())
    assert cached.kv_cache_manager.block_pool.num_evictions > 0
    assert cached.kv_cache_manager.block_pool.num_used_blocks == 0


def test_b14_full_cache_hit_still_computes_last_token():
    rng = random.Random(14)
    prompt = tokens(rng, 3 * BLOCK)
    engine = make_tiny_engine()
    scheduled_sizes = []
    original = engine.model_runner.execute_model

    def spy(batch):
        scheduled_sizes.extend(request.num_new_tokens for request in batch.requests)
        return original(batch)

    engine.model_runner.execute_model = spy
    first = run(engine, {"a": prompt})["a"]
    second = run(engine, {"b": prompt})["b"]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # The last block is recomputed (hits stop at num_tokens - 1, and only full blocks hit).
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 2 * BLOCK)
    assert min(scheduled_sizes) >= 1
    one_more = run(engine, {"c": prompt + [7]})["c"]
    assert one_more.num_cached_tokens == 3 * BLOCK
    stats = engine.get_kv_cache_stats()
    assert stats.prefix_cache_hits == 5 * BLOCK
    assert stats.prefix_cache_queries == 3 * BLOCK * 3 + 1


def test_b15_preemption_meets_prefix_cache(caplog):
    rng = random.Random(15)
    shared = [tokens(rng, 9), tokens(rng, 13)]
    prompts = {f"r{i}": shared[i % 2] + tokens(rng, rng.randint(1, 6)) for i in range(8)}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    # 20 blocks of 4 tokens for 8 requests growing to ~40 tokens: constant preemption, and
    # resumed requests find their own and their neighbours' blocks in the cache.
    engine = make_tiny_engine(num_gpu_blocks_override=20, max_num_batched_tokens=32, max_model_len=64)
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
        finals = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    # A warning at the first preemption and at every 50th (vLLM's cadence).
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert len(warnings) == 1 + engine.scheduler.num_preemptions // 50, warnings
    assert "1 preemptions so far" in warnings[0]
    assert engine.get_kv_cache_stats().prefix_cache_hits > 0
    # Reference: no cache and a pool big enough that nobody is preempted (batching itself
    # changes nothing: see test_core_engine).
    reference = run(make_tiny_engine(enable_prefix_caching=False, num_gpu_blocks_override=128),
                    prompts, params)
    assert token_ids(finals) == token_ids(reference)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_preemption_warning_names_the_samples_of_an_n_request(caplog):
    # Regression (CI, tp2 test): the samples of an n > 1 request have tuple ids, and the
    # preemption warning joined them as strings: TypeError inside the engine step.
    rng = random.Random(16)
    params = SamplingParams(n=4, temperature=1.0, seed=3, ignore_eos=True, max_tokens=24)
    # Each request alone needs 30 of the 32 blocks; the two together are preempted.
    engine = make_tiny_engine(num_gpu_blocks_override=32, max_num_batched_tokens=32, max_model_len=48)
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
        finals = run(engine, {"p": tokens(rng, 9), "q": tokens(rng, 9)}, params)
    assert engine.scheduler.num_preemptions > 0
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert "', " in warnings[0], warnings  # e.g. "preempted ('q', 3) (recompute)"
    for request_id in ("p", "q"):
        assert [len(c.token_ids) for c in finals[request_id].outputs] == [24] * 4
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def _computed_request(manager: KVCacheManager, request_id: str, prompt: list[int],
                      salt=None) -> Request:
    """A request whose prompt K/V counts as written, with its full blocks cached."""
    request = Request(request_id, prompt, GREEDY, 1, None, cache_salt=salt)
    assert manager.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    manager.cache_blocks(request)
    return request


def test_b17_hash_collisions_never_return_wrong_blocks():
    rng = random.Random(17)
    block_a, block_b, block_c = tokens(rng, BLOCK), tokens(rng, BLOCK), tokens(rng, BLOCK)
    for hash_fn in (lambda key: 0,  # every block collides
                    lambda key: hash(key[1:])):  # ignores the parent: same block after a different prefix
        manager = KVCacheManager(16, BLOCK, hash_fn=hash_fn)
        _computed_request(manager, "a", block_a + block_c + [1])
        probe = Request("b", block_b + block_c + [1], GREEDY, 1, None)
        assert manager.get_computed_blocks(probe) == ([], 0)
        # Now block_b is cached too (after other tokens): block_c may follow only block_a.
        _computed_request(manager, "bb", block_b + tokens(rng, BLOCK) + [1])
        blocks, num_cached = manager.get_computed_blocks(probe)
        assert num_cached == (0 if hash_fn(()) == 0 else BLOCK)
        assert all(block.block_hash.token_ids == tuple(block_b) for block in blocks)
        same = Request("a2", block_a + block_c + [2], GREEDY, 1, None)
        blocks, num_cached = manager.get_computed_blocks(same)
        assert num_cached == (BLOCK if hash_fn(()) == 0 else 2 * BLOCK)
        assert blocks[0].block_hash.token_ids == tuple(block_a)
        manager.block_pool.check_invariants()

    # End to end: with a constant hash the outputs still equal the uncached engine's.
    prompts = {str(i): (block_a if i % 2 else block_b) + tokens(rng, 5) for i in range(6)}
    colliding = make_tiny_engine()
    colliding.kv_cache_manager.hash_fn = lambda key: 0
    finals = {}
    for request_id, prompt in prompts.items():  # one by one, so later ones could hit
        finals.update(run(colliding, {request_id: prompt}))
    plain = run(make_tiny_engine(enable_prefix_caching=False), prompts)
    assert token_ids(finals) == token_ids(plain)


def test_b17_different_cache_salts_never_share():
    rng = random.Random(18)
    prompt = tokens(rng, 3 * BLOCK + 1)
    engine = make_tiny_engine()
    salted = run(engine, {"a": prompt}, cache_salt="alice")["a"]
    other = run(engine, {"b": prompt}, cache_salt="bob")["b"]
    unsalted = run(engine, {"c": prompt})["c"]
    engine.add_request("d", {"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY)
    same_salt = run_to_completion(engine)["d"]
    assert [o.num_cached_tokens for o in (salted, other, unsalted, same_salt)] == [0, 0, 0, 3 * BLOCK]
    assert len({tuple(o.outputs[0].token_ids) for o in (salted, other, unsalted, same_salt)}) == 1

    manager = KVCacheManager(16, BLOCK)
    first = _computed_request(manager, "x", prompt, salt="alice")
    second = _computed_request(manager, "y", prompt, salt="bob")
    assert not set(manager.get_block_ids("x")) & set(manager.get_block_ids("y"))
    assert manager.get_computed_blocks(Request("z", prompt, GREEDY, 1, None, cache_salt="bob"))[1] == 3 * BLOCK
    manager.free(first)
    manager.free(second)
    manager.block_pool.check_invariants()


def test_reset_prefix_cache_and_stats():
    rng = random.Random(19)
    prompt = tokens(rng, 2 * BLOCK + 2)
    engine = make_tiny_engine()
    run(engine, {"a": prompt})
    stats = engine.get_kv_cache_stats()
    # 2 prompt blocks + 1 block of generated tokens (prompt 10 + 5 computed of 6 output = 15 tokens).
    assert (stats.num_used_blocks, stats.num_cached_free_blocks) == (0, 3)
    assert stats.num_cached_free_blocks + stats.num_empty_free_blocks == stats.num_blocks
    assert engine.reset_prefix_cache()
    assert engine.get_kv_cache_stats().num_cached_free_blocks == 0
    assert run(engine, {"b": prompt})["b"].num_cached_tokens == 0

    # Mid-run figures: two requests sharing 2 cached blocks.
    engine.add_request("c", {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("d", {"prompt_token_ids": prompt[:2 * BLOCK] + [3, 4, 5]}, GREEDY)
    engine.step()
    stats = engine.get_kv_cache_stats()
    assert stats.num_shared_blocks == 2
    # c: 11 tokens computed (prompt + 1 sampled not yet computed -> 10), d: 11 -> 10 + 11 = 21,
    # minus the 8 tokens of the 2 shared blocks counted once.
    c, d = engine.scheduler.requests["c"], engine.scheduler.requests["d"]
    assert stats.num_stored_tokens == c.num_computed_tokens + d.num_computed_tokens - 2 * BLOCK
    assert stats.num_stored_tokens + stats.num_empty_slots == stats.num_used_blocks * BLOCK
    run_to_completion(engine)
    assert engine.get_kv_cache_stats().num_used_blocks == 0


def test_block_pool_evicts_least_recently_freed_and_revives_hits():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        assert pool.cache_block(block, BlockHash(i, (i,), ()), None)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    # Free queue: 3 (never used), then 1, 0, 2 in the order they were freed.
    pool.touch([blocks[0]])  # a hit takes block 0 out of the middle of the queue
    taken = pool.allocate(2)
    assert [block.block_id for block in taken] == [3, 1]
    assert blocks[1].cache_id is None and pool.num_evictions == 1
    assert pool.get_cached_block(BlockHash(2, (2,), ()), None) is blocks[2]
    assert pool.get_cached_block(BlockHash(1, (1,), ()), None) is None
    pool.check_invariants()
    stats = pool.get_stats()
    assert (stats.num_used_blocks, stats.num_cached_free_blocks, stats.num_empty_free_blocks) == (3, 1, 0)


def test_block_pool_hands_out_freed_uncached_blocks_first_and_evicts_cached_ones_last():
    """A freed block without cached content is reused before a never-used block (warm pages,
    no first-touch fault) and before any cached block is evicted; most recently freed first."""
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    assert [block.block_id for block in blocks] == [0, 1, 2, 3]
    assert pool.cache_block(blocks[0], BlockHash(0, (0,), ()), None)
    pool.free(blocks)  # 0 cached-free (back of the queue); 1, 2, 3 recycled
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 0]
    assert [block.block_id for block in pool.allocate(4)] == [3, 2, 1, 4]
    assert pool.get_cached_block(BlockHash(0, (0,), ()), None) is blocks[0] and pool.num_evictions == 0
    pool.reset_prefix_cache()  # block 0, free and now without content, is recycled too
    assert pool.free_block_ids() == [0, 5]
    pool.check_invariants()
    stats = pool.get_stats()
    assert (stats.num_used_blocks, stats.num_cached_free_blocks, stats.num_empty_free_blocks) == (4, 0, 2)


def test_engine_without_prefix_caching_reuses_the_same_blocks_request_after_request():
    """One request at a time, prefix caching off: every request runs in the blocks the one
    before it freed, so the pool's untouched blocks stay untouched (and unmapped)."""
    engine = make_tiny_engine(enable_prefix_caching=False)
    pool = engine.kv_cache_manager.block_pool
    rng = random.Random(0)
    seen: set[int] = set()
    original_allocate = pool.allocate

    def allocate(count):
        taken = original_allocate(count)
        seen.update(block.block_id for block in taken)
        return taken

    pool.allocate = allocate
    for index in range(5):
        run(engine, {f"r{index}": tokens(rng, 3 * BLOCK)})
    # 12 prompt + 6 new tokens need 5 blocks of 4 (the last token's K/V is never written).
    assert len(seen) == 5 and pool.num_free_blocks == pool.num_blocks
