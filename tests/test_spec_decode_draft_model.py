"""Speculative decoding with ``method="draft_model"`` (spec_decode/draft_model_proposer.py) on
tiny llamas: greedy output against non-speculative decoding (a draft that is the target, one that
is its first layer), the draft pool's invariants through preemption, n > 1, budget cuts and
abort, batched draft forwards, the KV budget split, the sampled distribution, counters and
refusals. SmolLM2 drafting for itself and its int4 variant drafting for it, against
transformers, are in test_spec_decode.py beside the other SmolLM2 tests (one reference run).
"""

from __future__ import annotations

from collections import Counter

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.core.request import RequestStatus
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.metrics import EngineMetrics
from pagedllm.spec_decode import DraftModelProposer
from pagedllm.utils import cdiv
from pagedllm.worker.kv_cache_sizing import bytes_per_block
from tests.conftest import make_tiny_engine, run_to_completion, save_tiny_checkpoint, tiny_config
from tests.test_spec_decode import (repetitive_prompts, run_counting_drafts,
                                    run_to_completion_outputs, sample_sequences, step_checking_rollback,
                                    two_sample_p_value)

K = 4


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    """Tiny drafts as Hugging Face folders, by name: ``self`` (the weights of
    ``make_tiny_engine``'s model), ``smaller`` (its embedding, first layer, norm and head: a
    1-layer model), ``vocab8`` (a 1-layer model of ``small_vocab_model``'s first layer) and
    ``short`` (``self`` with a 64-token context)."""
    folders = {}
    for name, seed, config in (("self", 0, tiny_config()), ("smaller", 0, tiny_config(num_hidden_layers=1)),
                               ("vocab8", 5, tiny_config(vocab_size=8, num_hidden_layers=1)),
                               ("short", 0, tiny_config(max_position_embeddings=64))):
        # tiny_state_dict draws the embedding, norm and head first, then layer by layer, so a
        # 1-layer model of the same seed is the first layer of the 2-layer one.
        folders[name] = save_tiny_checkpoint(tmp_path_factory.mktemp(name), config, seed)
    return folders


def draft_config(folder: str, **overrides) -> dict:
    return dict({"model": folder, "num_speculative_tokens": K, "disable_by_batch_size": None}, **overrides)


def check_draft_pool(engine: LLMEngine) -> None:
    """The draft's pool is consistent, holds state only for running requests not preempted
    since, and each one's table covers at most its tokens plus ``K - 1`` drafted positions."""
    proposer = engine.proposer
    manager = proposer.kv_cache_manager
    manager.block_pool.check_invariants()
    for request_id, sequence in proposer._sequences.items():
        request = sequence.request
        assert request.status == RequestStatus.RUNNING and request.num_preemptions == sequence.num_preemptions
        assert len(manager.req_to_blocks[request_id]) <= cdiv(request.num_tokens + K - 1, manager.block_size)
    assert set(manager.req_to_blocks) == set(proposer._sequences)


def run_checked(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> dict:
    """Run to the end, checking the target's rollback invariants and the draft pool after every
    step; afterwards neither pool holds a block. The final ``RequestOutput``s by id."""
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    finals = step_checking_rollback(engine, check_draft_pool)
    for manager in (engine.kv_cache_manager, engine.proposer.kv_cache_manager):
        assert manager.block_pool.num_used_blocks == 0 and not manager.req_to_blocks
    assert not engine.proposer._sequences
    return finals


@pytest.mark.parametrize("draft", ["self", "smaller"])
def test_greedy_output_equals_non_speculative(drafts, draft):
    """The target drafting for itself has every draft accepted; its 1-layer cut gets some
    accepted and some rejected. The output equals non-speculative greedy decoding in both."""
    prompts = repetitive_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 7 * i, ignore_eos=True) for i in range(6)]
    expected = run_to_completion_outputs(make_tiny_engine(), prompts, params)
    engine = make_tiny_engine(speculative_config=draft_config(drafts[draft]))
    finals = run_checked(engine, prompts, params)
    for i in range(6):
        assert finals[f"r{i}"].outputs[0].token_ids == expected[i], i
    stats = engine.make_stats()
    if draft == "self":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    else:
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("max_num_batched_tokens", [12, 8])
def test_preemption_n2_logprobs_penalties_and_budget_cuts_equal_non_speculative(drafts, max_num_batched_tokens):
    """A pool too small for all (preemption; with a budget of 12 some preempted requests had
    draft blocks), n=2, logprobs, a penalized request (no drafts) and a budget that passes
    requests over in some steps (8: they draft again from the same tokens): outputs, finish
    reasons and logprobs equal non-speculative decoding, and the draft pool stays consistent
    (a preempted request's draft blocks are freed) and is empty at the end."""
    prompts = repetitive_prompts(5)
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, n=2),
              SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=35)]
    options = dict(num_gpu_blocks_override=24, max_model_len=80, max_num_seqs=8,
                   max_num_batched_tokens=max_num_batched_tokens)
    base_engine = make_tiny_engine(**options)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        base_engine.add_request(f"r{i}", prompt, param)
    base = run_to_completion(base_engine)
    engine = make_tiny_engine(speculative_config=draft_config(drafts["self"]), **options)
    spec = run_checked(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.make_stats().spec_decode_num_accepted_tokens > 0
    for request_id, output in base.items():
        for a, b in zip(output.outputs, spec[request_id].outputs, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), request_id
            if a.logprobs is not None:
                assert [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
                assert [x.logprob for d in a.logprobs for x in d.values()] == pytest.approx(
                    [x.logprob for d in b.logprobs for x in d.values()], abs=1e-4)


def test_abort_frees_the_draft_blocks(drafts):
    engine = make_tiny_engine(speculative_config=draft_config(drafts["self"]))
    for i, prompt in enumerate(repetitive_prompts(3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    while len(engine.proposer._sequences) < 3:
        engine.step()
    manager = engine.proposer.kv_cache_manager
    used = manager.block_pool.num_used_blocks
    held = len(manager.req_to_blocks["r1"])
    engine.abort_request("r1")
    assert "r1" not in engine.proposer._sequences and manager.block_pool.num_used_blocks == used - held
    check_draft_pool(engine)
    engine.abort_request(["r0", "r2"])
    assert manager.block_pool.num_used_blocks == 0 and not engine.proposer._sequences
    manager.block_pool.check_invariants()


def test_each_draft_forward_batches_every_candidate(drafts):
    """Per step: one catch-up forward over all candidates, then one-token forwards over all
    that may draft more (the budget holds every catch-up here)."""
    engine = make_tiny_engine(speculative_config=draft_config(drafts["smaller"]), max_num_batched_tokens=128)
    proposer = engine.proposer
    calls = []
    forward, propose_batch = proposer._forward, proposer.propose_batch

    def forward_spy(batch):
        calls[-1][1].append(len(batch))
        return forward(batch)

    def propose_spy(candidates):
        calls.append(([max_num_tokens for _, max_num_tokens in candidates], []))
        return propose_batch(candidates)

    proposer._forward, proposer.propose_batch = forward_spy, propose_spy
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    run_to_completion_outputs(engine, repetitive_prompts(4), [params] * 4)
    assert sum(limits == [K] * 4 for limits, _ in calls) > 3
    for limits, sizes in calls:
        if limits:
            assert sizes == [len(limits)] + [sum(m > step for m in limits) for step in range(1, max(limits))]


def test_kv_budget_is_split_between_target_and_draft(drafts):
    """Both pools get ``budget // (target block bytes + draft block bytes)`` blocks."""
    target_only = make_tiny_engine(num_gpu_blocks_override=None, kv_cache_memory_bytes=1 << 20)
    engine = make_tiny_engine(num_gpu_blocks_override=None, kv_cache_memory_bytes=1 << 20,
                              speculative_config=draft_config(drafts["smaller"]))
    target_bytes = bytes_per_block(engine.model, 4, engine.kv_cache_dtype)
    draft_bytes = bytes_per_block(engine.proposer.model, 4, engine.kv_cache_dtype)
    assert draft_bytes * 2 == target_bytes  # one layer of two
    assert target_only.num_blocks == (1 << 20) // target_bytes
    assert engine.num_blocks == (1 << 20) // (target_bytes + draft_bytes) < target_only.num_blocks
    assert engine.proposer.kv_cache_manager.num_blocks == engine.num_blocks
    assert all(cache.shape[0] == engine.num_blocks for layer in engine.proposer.kv_caches for cache in layer)


def test_sampled_sequences_have_the_non_speculative_distribution(drafts):
    """Temperature 1.5 on an 8-token-vocabulary model: 800 seeded 4-token samples with the
    1-layer cut's greedy drafts (deterministic proposals, as prompt lookup's) have each
    position's and the (second, third) pair's distribution of non-speculative sampling
    (two-sample chi-square)."""
    plain = sample_sequences(None, 800)
    spec = sample_sequences(draft_config(drafts["vocab8"], num_speculative_tokens=3), 800)

    def project(counts: Counter, index) -> Counter:
        projected = Counter()
        for tokens, count in counts.items():
            projected[tokens[index]] += count
        return projected

    for index in (0, 1, 2, 3, slice(1, 3)):
        assert two_sample_p_value(project(plain, index), project(spec, index)) > 1e-3, index


def test_counters_count_draft_model_drafts(drafts):
    """The spec_decode counters equal the drafts scheduled and accepted; Prometheus shows them."""
    engine = make_tiny_engine(speculative_config=draft_config(drafts["smaller"]))
    scheduled, accepted = run_counting_drafts(engine, 3, max_tokens=25)
    stats = engine.make_stats()
    assert stats.spec_decode_num_drafts == len(scheduled) > 0
    assert stats.spec_decode_num_draft_tokens == sum(map(len, scheduled))
    assert stats.spec_decode_num_accepted_tokens == sum(accepted) > 0
    metrics = EngineMetrics("m", 64, 4, 128, log_interval=None)
    metrics.update_gauges(stats)
    text = metrics.render().decode()
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(sum(map(len, scheduled)))}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(sum(accepted))}' in text


def test_refusals(drafts):
    with pytest.raises(ValueError, match="vocabulary of 8 tokens, the target model 256"):
        make_tiny_engine(speculative_config=draft_config(drafts["vocab8"]))
    with pytest.raises(ValueError, match="context of 64 tokens, fewer than max_model_len=128"):
        make_tiny_engine(speculative_config=draft_config(drafts["short"]))
    with pytest.raises(ValueError, match="does not exist"):
        make_tiny_engine(speculative_config=draft_config(drafts["self"] + "-missing"))
    with pytest.raises(ValueError, match="'draft_model' with tensor_parallel_size=2 is not supported"):
        EngineArgs.from_kwargs(tensor_parallel_size=2, speculative_config=draft_config(drafts["self"]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_after_rollback_equal_drafts_from_scratch(drafts, temperature):
    """After every step, the proposer's drafts equal those of a new proposer over the same
    model that computes every request's tokens from the start: the rollback keeps exactly the
    K/V of the accepted tokens. Drafts are rejected and accepted (greedy and sampled), and a
    third request turns drafting off for a few steps (``disable_by_batch_size=2``), so that
    requests come back with several tokens past their last drafts."""
    engine = make_tiny_engine(speculative_config=draft_config(drafts["smaller"], disable_by_batch_size=2))
    proposer = engine.proposer
    propose_batch = proposer.propose_batch
    compared = []

    def propose_spy(candidates):
        result = propose_batch(candidates)
        fresh = DraftModelProposer(engine.args.speculative, proposer.model, engine.model.config, 64, engine.args,
                                   engine.kv_cache_dtype, engine.max_model_len)
        assert fresh.propose_batch(candidates) == result
        compared.append(sum(map(len, result)))
        return result

    proposer.propose_batch = propose_spy
    prompts = repetitive_prompts(3)
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], SamplingParams(temperature=temperature, max_tokens=40,
                                                               ignore_eos=True, seed=i))
    for _ in range(4):
        engine.step()
    engine.add_request("r2", prompts[2], SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.make_stats()
    assert 0 in compared and sum(compared) > 50
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
