"""No input that ``LLMEngine.add_request`` accepts may make ``step()`` raise (issue 19.3, the
whole kind): random request ids, prompts and sampling parameters, including values at the
edges of their ranges, are either refused by ``add_request`` with a ``ValueError`` (nothing
queued) or run to an end, interleaved with aborts, in a pool small enough to preempt; every
block comes back.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_engine

valid_ids = st.integers(0, TINY_VOCAB - 1)
token_ids = st.integers(-2, TINY_VOCAB + 2)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)

# Values inside each field's range (most draws) ...
valid_kwargs = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, TINY_VOCAB + 5),
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 3.0),
    "seed": st.one_of(st.none(), st.integers(0, 2**63)),
    "stop_token_ids": st.lists(valid_ids, max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": st.one_of(st.none(), st.integers(0, 40)),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "logit_bias": st.dictionaries(valid_ids, st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(valid_ids, min_size=1, max_size=4),
    "output_kind": st.sampled_from(list(RequestOutputKind)),
    "truncate_prompt_tokens": st.one_of(st.none(), st.just(-1), st.integers(1, 50)),
})
# ... and anything near or past the edges (the rest).
wild_kwargs = st.fixed_dictionaries({}, optional={
    "n": st.integers(-1, 6), "temperature": floats, "top_p": floats, "top_k": st.integers(-3, 2**40),
    "min_p": floats, "repetition_penalty": floats, "seed": st.integers(-5, 2**65),
    "stop_token_ids": st.lists(token_ids, max_size=3), "max_tokens": st.integers(-2, 100),
    "min_tokens": st.integers(-1, 100), "logprobs": st.integers(-2, 10**6),
    "prompt_logprobs": st.integers(-2, 10**6), "logit_bias": st.dictionaries(token_ids, floats, max_size=3),
    "allowed_token_ids": st.lists(token_ids, max_size=4), "truncate_prompt_tokens": st.integers(-3, 60),
})
prompts = st.lists(valid_ids, min_size=1, max_size=40)
requests = st.lists(st.tuples(
    st.one_of(*[st.sampled_from(["a", "0_a", "1_a", "b", "('a', 0)"])] * 3, st.text(max_size=4), st.integers(0, 3)),
    st.one_of(prompts, prompts.map(lambda p: {"prompt_token_ids": p}), st.lists(token_ids, max_size=40)),
    st.one_of(valid_kwargs, valid_kwargs, valid_kwargs, wild_kwargs),
    st.integers(0, 6),  # abort after this many steps (6: never)
), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_no_accepted_request_makes_step_raise(batch):
    engine = make_tiny_engine(num_gpu_blocks_override=12, max_model_len=48, max_num_seqs=4,
                              max_num_batched_tokens=16)
    pool = engine.kv_cache_manager.block_pool
    accepted, aborts = set(), {}
    for request_id, prompt, kwargs, abort_after in batch:
        try:
            params = SamplingParams(**kwargs)
            engine.add_request(request_id, prompt, params)
        except ValueError:
            continue
        accepted.add(request_id)
        aborts.setdefault(abort_after, []).append(request_id)
    finished = {}
    for step in range(2_000):
        if not engine.has_unfinished_requests():
            break
        engine.abort_request(aborts.pop(step, []))
        for output in engine.step():
            assert output.request_id in accepted
            if output.finished:
                assert output.request_id not in finished, "a request finished twice"
                finished[output.request_id] = output
        pool.check_invariants()
    assert not engine.has_unfinished_requests(), "the engine did not finish within 2,000 steps"
    assert set(finished) == accepted
    assert all(c.finish_reason in ("stop", "length", "abort") for o in finished.values() for c in o.outputs)
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("prompts", [None, 123, 4.5])
def test_generate_refuses_a_prompts_argument_that_is_no_prompt_nor_list(prompts):
    from pagedllm import LLM

    llm = LLM.__new__(LLM)  # the check comes before any engine work
    with pytest.raises(ValueError, match=f"prompts must be a string, .* got {type(prompts).__name__}"):
        llm.generate(prompts)
