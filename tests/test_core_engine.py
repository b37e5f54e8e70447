"""Engine logic on a tiny random llama: scheduling, preemption, admission, block accounting."""

from __future__ import annotations

import random

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.core.request import Request
from tests.conftest import TINY_VOCAB, make_tiny_engine, run_to_completion

GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(length)]


def run_alone(prompt: list[int], params: SamplingParams, **engine_kwargs) -> list[int]:
    engine = make_tiny_engine(**engine_kwargs)
    engine.add_request("alone", {"prompt_token_ids": prompt}, params)
    return run_to_completion(engine)["alone"].outputs[0].token_ids


def assert_pool_consistent(engine) -> None:
    pool = engine.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def test_batched_greedy_equals_alone_with_chunked_prefill():
    rng = random.Random(0)
    prompts = [random_prompt(rng, n) for n in (1, 3, 17, 40, 90)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    engine = make_tiny_engine(max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        expected = run_alone(prompt, params, max_num_batched_tokens=128)
        assert finals[str(i)].outputs[0].token_ids == expected
        assert finals[str(i)].outputs[0].finish_reason == "length"


def test_b18_preemption_changes_nothing_greedy():
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(5, 30)) for _ in range(8)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    # 24 blocks of 4 tokens = 96 slots for 8 requests growing to ~70 tokens each.
    engine = make_tiny_engine(num_gpu_blocks_override=24, max_model_len=96)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        assert_pool_consistent(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].token_ids == run_alone(prompt, params)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_block_pool_invariants_random_workload_with_aborts():
    rng = random.Random(2)
    engine = make_tiny_engine(num_gpu_blocks_override=40, max_model_len=64, max_num_seqs=8,
                              max_num_batched_tokens=32)
    pool = engine.kv_cache_manager.block_pool
    live: set[str] = set()
    next_id = 0
    steps = 0
    while next_id < 300 or engine.has_unfinished_requests():
        if next_id < 300:
            for _ in range(rng.randint(0, 3)):
                length = rng.randint(1, 40)
                max_tokens = rng.randint(1, 64 - length)
                engine.add_request(str(next_id), {"prompt_token_ids": random_prompt(rng, length)},
                                   SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=next_id))
                live.add(str(next_id))
                next_id += 1
        if live and rng.random() < 0.15:
            engine.abort_request(rng.choice(sorted(live)))
        for output in engine.step():
            if output.finished:
                live.discard(output.request_id)
        assert_pool_consistent(engine)
        # Every used block belongs to exactly one live request's table (no sharing without
        # prefix caching hits on random prompts is not guaranteed, so count references).
        referenced = sum(len(b) for b in engine.kv_cache_manager.req_to_blocks.values())
        assert referenced >= pool.num_used_blocks
        steps += 1
        assert steps < 20_000
    assert not live
    assert pool.num_used_blocks == 0
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.kv_cache_manager.req_to_blocks


def test_b02_no_block_leaks_ever():
    rng = random.Random(3)
    engine = make_tiny_engine(max_model_len=64)
    pool = engine.kv_cache_manager.block_pool
    baseline = pool.num_used_blocks
    params = SamplingParams(max_tokens=10, **GREEDY)
    for i in range(5):
        engine.add_request(f"seq{i}", {"prompt_token_ids": random_prompt(rng, 20)}, params)
        run_to_completion(engine)
        assert pool.num_used_blocks == baseline
    for i in range(5):
        with pytest.raises(ValueError, match="max_model_len=64"):
            engine.add_request(f"bad{i}", {"prompt_token_ids": random_prompt(rng, 60)},
                               SamplingParams(max_tokens=10))
        engine.add_request(f"ok{i}", {"prompt_token_ids": random_prompt(rng, 20)}, params)
        finals = run_to_completion(engine)
        assert finals[f"ok{i}"].outputs[0].finish_reason == "length"
        assert pool.num_used_blocks == baseline
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.has_unfinished_requests()


def test_b04_abort_waiting_request():
    rng = random.Random(4)
    prompts = [random_prompt(rng, 10) for _ in range(2)]
    params = SamplingParams(max_tokens=30, **GREEDY)
    engine = make_tiny_engine(max_num_seqs=2, max_num_batched_tokens=32)
    allocated_for: set[str] = set()
    original = engine.kv_cache_manager.allocate_slots

    def spy(request, *args):
        allocated_for.add(request.request_id)
        return original(request, *args)

    engine.kv_cache_manager.allocate_slots = spy
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.add_request("R", {"prompt_token_ids": random_prompt(rng, 10)}, params)
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["R"]
    engine.abort_request("R")
    assert not engine.scheduler.waiting
    finals = run_to_completion(engine)
    aborted = finals["R"]
    assert aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].text == "" and aborted.outputs[0].token_ids == []
    assert "R" not in allocated_for
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].token_ids == run_alone(prompt, params)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_abort_running_request_frees_blocks_at_once():
    rng = random.Random(5)
    engine = make_tiny_engine()
    engine.add_request("a", {"prompt_token_ids": random_prompt(rng, 30)}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": random_prompt(rng, 30)}, SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    used_by_b = len(engine.kv_cache_manager.req_to_blocks["b"])
    used = engine.kv_cache_manager.block_pool.num_used_blocks
    engine.abort_request("a")
    assert engine.kv_cache_manager.block_pool.num_used_blocks == used_by_b < used
    finals = run_to_completion(engine)
    assert finals["a"].outputs[0].finish_reason == "abort"
    assert finals["b"].finished
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_b05_never_fitting_request_is_rejected():
    rng = random.Random(6)
    engine = make_tiny_engine(block_size=16, num_gpu_blocks_override=50, max_model_len=None,
                              max_num_batched_tokens=256)
    capacity = 50 * 16
    assert engine.max_model_len == capacity
    for i in range(10):
        engine.add_request(f"short{i}", {"prompt_token_ids": random_prompt(rng, 12)},
                           SamplingParams(max_tokens=50, **GREEDY))
    for i in range(5):
        with pytest.raises(ValueError, match=f"{capacity} tokens: 50 blocks of 16"):
            engine.add_request(f"long{i}", {"prompt_token_ids": random_prompt(rng, 1000)},
                               SamplingParams(max_tokens=16))
    finals = run_to_completion(engine)
    assert all(finals[f"short{i}"].outputs[0].finish_reason == "length" for i in range(10))
    # The boundary: prompt + max_tokens == capacity runs; one token more is refused.
    max_tokens = 8
    engine.add_request("edge", {"prompt_token_ids": random_prompt(rng, capacity - max_tokens)},
                       SamplingParams(max_tokens=max_tokens, **GREEDY))
    with pytest.raises(ValueError, match=f"{capacity + 1} tokens exceeds max_model_len={capacity}"):
        engine.add_request("edge+1", {"prompt_token_ids": random_prompt(rng, capacity - max_tokens + 1)},
                           SamplingParams(max_tokens=max_tokens))
    finals = run_to_completion(engine)
    assert len(finals["edge"].outputs[0].token_ids) == max_tokens
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_configuration_that_cannot_hold_max_model_len_is_refused():
    with pytest.raises(ValueError, match="KV cache holds 64 tokens.*max_model_len=128"):
        make_tiny_engine(num_gpu_blocks_override=16, max_model_len=128)


def test_b08_prompt_longer_than_max_model_len_token_ids():
    engine = make_tiny_engine(max_model_len=32)
    for length in (33, 64):
        with pytest.raises(ValueError, match=f"the prompt has {length} tokens, but max_model_len is 32"):
            engine.add_request(f"p{length}", {"prompt_token_ids": [1] * length}, SamplingParams())
    engine.add_request("fine", {"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=4))
    assert run_to_completion(engine)["fine"].finished


def test_b09_prompt_longer_than_token_budget_is_chunked():
    rng = random.Random(7)
    prompt = random_prompt(rng, 2049)
    params = SamplingParams(max_tokens=4, **GREEDY)
    kwargs = dict(block_size=16, num_gpu_blocks_override=256, max_model_len=4096, max_num_seqs=8)
    chunked = run_alone(prompt, params, max_num_batched_tokens=2048, **kwargs)
    whole = run_alone(prompt, params, max_num_batched_tokens=4096, **kwargs)
    assert chunked == whole and len(chunked) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2 is not supported"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
    (dict(distributed_executor_backend="ray"), "'distributed_executor_backend' is not supported"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False is not supported"),
    (dict(dtype="int3"), "dtype must be one of"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens \\(8\\) must be >= max_num_seqs"),
])
def test_unsupported_or_invalid_options_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(**kwargs)


def test_vllm_options_that_change_nothing_here_are_accepted():
    """A vLLM configuration's GPU-only knobs and ``enable_chunked_prefill=True`` (always on here)
    build the same arguments as without them (a new user's vLLM script was refused)."""
    plain = EngineArgs.from_kwargs(max_model_len=64)
    assert EngineArgs.from_kwargs(max_model_len=64, enable_chunked_prefill=True, swap_space=4,
                                  max_seq_len_to_capture=8192, enforce_eager=True) == plain


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ({"prompt_token_ids": [TINY_VOCAB]}, f"outside the vocabulary \\[0, {TINY_VOCAB}\\)"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
])
def test_bad_prompts_are_rejected_and_engine_keeps_serving(prompt, message):
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams())
    engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    assert run_to_completion(engine)["bad"].finished


def test_duplicate_request_id_in_flight_is_rejected():
    engine = make_tiny_engine()
    engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("x", {"prompt_token_ids": [3]}, SamplingParams(max_tokens=3))
    finals = run_to_completion(engine)
    assert finals["x"].prompt_token_ids == [1, 2]


def test_user_request_ids_never_collide_with_sample_ids():
    """Issue 19.3: a user id equal to the id pagedllm once derived for a sample ("0_a" beside a
    request "a" with n=2) made step() raise KeyError; samples now have ids no string equals."""
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3)
    engine = make_tiny_engine()
    for request_id, n in (("a", 2), ("0_a", 1), ("1_a", 2), ("('a', 0)", 1)):
        engine.add_request(request_id, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(
            n=n, max_tokens=4, temperature=1.0, seed=3))
    finals = run_to_completion(engine)
    assert sorted(finals) == ["('a', 0)", "0_a", "1_a", "a"]
    assert [len(finals[rid].outputs) for rid in ("a", "0_a", "1_a")] == [2, 1, 2]
    alone = make_tiny_engine()
    alone.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    assert ([o.token_ids for o in run_to_completion(alone)["a"].outputs]
            == [o.token_ids for o in finals["a"].outputs])
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("request_id", [None, 7, ("a", 0), b"a"])
def test_non_string_request_id_is_a_value_error(request_id):
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_stop_token_ids_and_eos():
    rng = random.Random(8)
    prompt = random_prompt(rng, 8)
    free_run = run_alone(prompt, SamplingParams(max_tokens=20, **GREEDY))
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    stopped = make_tiny_engine()
    stopped.add_request("s", {"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at]))
    out = run_to_completion(stopped)["s"].outputs[0]
    assert out.token_ids == free_run[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_max_tokens_none_runs_to_max_model_len():
    engine = make_tiny_engine(max_model_len=24)
    engine.add_request("r", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=None, **GREEDY))
    out = run_to_completion(engine)["r"].outputs[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    # min_tokens is checked against that resolved max_tokens too (a fresh user's report: the
    # server ran min_tokens=2000 without max_tokens to "length")
    with pytest.raises(ValueError, match="min_tokens=15 is more than the 14 tokens that max_model_len=24 "
                                         "leaves after the 10-token prompt"):
        engine.add_request("r2", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=None, min_tokens=15))
    engine.add_request("r3", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=None, min_tokens=14,
                                                                           **GREEDY))
    assert len(run_to_completion(engine)["r3"].outputs[0].token_ids) == 14
    engine.kv_cache_manager.block_pool.check_invariants()


def test_request_tracks_num_computed_tokens_across_preemption():
    request = Request("r", [1, 2, 3], SamplingParams(), max_tokens=4, eos_token_id=None)
    assert request.num_tokens == 3 and request.num_computed_tokens == 0
    request.output_token_ids.append(9)
    assert request.all_token_ids == [1, 2, 3, 9] and request.token_id_at(3) == 9
