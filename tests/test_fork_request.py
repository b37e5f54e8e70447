"""``LLMEngine.fork_request``: the engine primitive under beam search."""

from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams
from tests.conftest import make_tiny_engine, run_to_completion
from tests.test_cow_and_beam import tokens


def test_fork_shares_blocks_and_continues_as_a_request_given_that_token():
    rng = random.Random(3)
    prompt = tokens(rng, 9)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=3)
    engine = make_tiny_engine()
    engine.add_request("parent", {"prompt_token_ids": prompt}, params)
    (output,) = engine.step()
    alternative = [t for t in output.outputs[0].logprobs[-1] if t != output.outputs[0].token_ids[-1]][0]
    used = engine.kv_cache_manager.block_pool.num_used_blocks
    engine.fork_request("parent", "child", alternative)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == used  # shared, not copied
    engine.abort_request("parent")
    finals = run_to_completion(engine)
    child = finals["child"].outputs[0]
    assert child.token_ids[0] == alternative and len(child.token_ids) == 6
    assert len(child.logprobs) == 6 and child.cumulative_logprob == pytest.approx(
        sum(entry[token].logprob for entry, token in zip(child.logprobs, child.token_ids)))

    # The same continuation, computed from scratch.
    reference = make_tiny_engine(enable_prefix_caching=False)
    reference.add_request("r", {"prompt_token_ids": prompt + [alternative]}, params.clone(max_tokens=5))
    assert run_to_completion(reference)["r"].outputs[0].token_ids == child.token_ids[1:]
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_fork_refuses_what_it_cannot_fork():
    engine = make_tiny_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))
    with pytest.raises(ValueError, match="no sampled token to replace"):
        engine.fork_request("a", "b", 1)
    (output,) = engine.step()
    record = output.outputs[0].logprobs[-1]
    unseen = next(t for t in range(100) if t not in record)
    with pytest.raises(ValueError, match="neither the token"):
        engine.fork_request("a", "b", unseen)
    with pytest.raises(ValueError, match="already in flight"):
        engine.fork_request("a", "a", output.outputs[0].token_ids[-1])
    with pytest.raises(ValueError, match="one sequence"):
        engine.fork_request("missing", "b", 1)
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()
    with pytest.raises(ValueError, match="has no logprobs"):
        engine.fork_request("plain", "b", 1)
