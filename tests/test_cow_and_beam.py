"""Forked samples (n > 1), copy-on-write, and beam search against Hugging Face transformers."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.beam_search import beam_search
from pagedllm.core.request import RequestStatus
from tests.conftest import TINY_VOCAB, hf_tiny_model, make_tiny_engine, run_to_completion

BLOCK = 4  # make_tiny_engine's block size


def tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(TINY_VOCAB) for _ in range(length)]


def samples(engine, prompt: list[int], params: SamplingParams, request_id: str = "p") -> list[list[int]]:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    output = run_to_completion(engine)[request_id]
    engine.kv_cache_manager.block_pool.check_invariants()
    return [completion.token_ids for completion in output.outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])  # int8: the copies carry each row's scale
def test_n4_prefills_once_and_copies_the_shared_partial_block_on_second_writer(kv_cache_dtype):
    prompt = tokens(random.Random(1), 2 * BLOCK + 2)
    params = SamplingParams(n=4, temperature=0.0, ignore_eos=True, max_tokens=8)
    engine = make_tiny_engine(kv_cache_dtype=kv_cache_dtype)
    kv = engine.kv_cache_manager
    pool = kv.block_pool
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt once, then the samples fork, each with its own first token
    tables = [kv.get_block_ids(("p", i)) for i in range(4)]
    assert all(table == tables[0] for table in tables) and len(tables[0]) == 3
    assert [pool.blocks[b].ref_count for b in tables[0]] == [4, 4, 4]
    assert pool.num_used_blocks == 3 and kv.num_copies == 0
    shared_partial = tables[0][2]

    engine.step()  # every sample writes its first token into the shared partial block
    tables = [kv.get_block_ids(("p", i)) for i in range(4)]
    assert kv.num_copies == 3  # three copies; the last writer keeps the original
    assert all(table[:2] == tables[0][:2] for table in tables)
    assert [pool.blocks[b].ref_count for b in tables[0][:2]] == [4, 4]
    last_blocks = [table[2] for table in tables]
    assert len(set(last_blocks)) == 4 and shared_partial in last_blocks
    # The copies hold the prompt's two tokens of that block exactly as the original does.
    key_cache, value_cache = engine.model_runner.kv_caches[0]
    for block in last_blocks:
        torch.testing.assert_close(key_cache[block, :2], key_cache[shared_partial, :2], rtol=0, atol=0)
        torch.testing.assert_close(value_cache[block, :2], value_cache[shared_partial, :2], rtol=0, atol=0)
    pool.check_invariants()

    finals = run_to_completion(engine)
    single = samples(make_tiny_engine(kv_cache_dtype=kv_cache_dtype), prompt,
                     SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8))
    assert [c.token_ids for c in finals["p"].outputs] == single * 4
    assert kv.num_copies == 3 and pool.num_used_blocks == 0


def test_no_copy_without_a_second_writer():
    rng = random.Random(2)
    engine = make_tiny_engine()
    kv = engine.kv_cache_manager
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=7)
    # Prompt of whole blocks: the samples' first tokens go to fresh blocks.
    samples(engine, tokens(rng, 2 * BLOCK), SamplingParams(n=3, temperature=0.0, ignore_eos=True, max_tokens=7))
    # Prefix-cache sharing: full blocks are shared but never written.
    prompt = tokens(rng, 3 * BLOCK + 1)
    samples(engine, prompt, greedy, "a")
    samples(engine, prompt + [5, 6], greedy, "b")
    assert kv.prefix_cache_hits == 3 * BLOCK
    assert kv.num_copies == 0


def test_seeded_samples_differ_repeat_and_equal_independent_seeds():
    prompt = tokens(random.Random(3), 9)
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    engine = make_tiny_engine()
    first = samples(engine, prompt, params, "a")
    again = samples(engine, prompt, params, "b")
    assert first == again
    assert len({tuple(s) for s in first}) > 1
    # Sample i draws from the stream seeded seed + i, as an n=1 request with that seed.
    for index, sample in enumerate(first):
        single = SamplingParams(temperature=1.0, seed=123 + index, max_tokens=10, ignore_eos=True)
        assert samples(make_tiny_engine(enable_prefix_caching=False), prompt, single) == [sample]


def test_aborting_parents_or_children_leaks_no_block():
    rng = random.Random(4)
    params = SamplingParams(n=3, temperature=0.0, ignore_eos=True, max_tokens=12)
    engine = make_tiny_engine(max_num_batched_tokens=8, max_num_seqs=8)
    pool = engine.kv_cache_manager.block_pool

    engine.add_request("chunked", {"prompt_token_ids": tokens(rng, 30)}, params)
    engine.step()  # a prefill chunk: the samples have not forked yet
    engine.abort_request("chunked")
    assert pool.num_used_blocks == 0

    engine.add_request("forked", {"prompt_token_ids": tokens(rng, 6)}, params)
    for _ in range(3):
        engine.step()
    assert pool.get_stats().num_shared_blocks > 0
    engine.abort_request("forked")
    assert pool.num_used_blocks == 0

    engine.add_request("child", {"prompt_token_ids": tokens(rng, 6)}, params)
    engine.step()
    engine.scheduler.finish_requests([("child", 1)], RequestStatus.FINISHED_ABORTED)
    pool.check_invariants()
    finals = run_to_completion(engine)
    assert [c.finish_reason for c in finals["child"].outputs] == ["length", "abort", "length"]
    assert pool.num_used_blocks == 0
    pool.check_invariants()


def test_b07_n_larger_than_max_num_seqs():
    engine = make_tiny_engine(max_num_seqs=4)
    with pytest.raises(ValueError, match=r"n=8 is larger than max_num_seqs=4"):
        engine.add_request("x", [1, 2, 3], SamplingParams(n=8))
    with pytest.raises(ValueError, match=r"n=2 is larger than max_num_seqs=1"):
        make_tiny_engine(max_num_seqs=1).add_request("y", [1, 2, 3], SamplingParams(n=2))
    # 2 shared prompt blocks + 3 samples x 6 blocks of their own.
    with pytest.raises(ValueError, match=r"needs 20 KV blocks .* has 16 blocks"):
        make_tiny_engine(num_gpu_blocks_override=16, max_model_len=64).add_request(
            "z", [1] * 8, SamplingParams(n=3, max_tokens=24))
    assert not engine.has_unfinished_requests()


def test_samples_take_turns_within_max_num_seqs_and_survive_preemption():
    rng = random.Random(7)
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
    prompts = {str(i): tokens(rng, rng.randint(3, 9)) for i in range(5)}
    num_samples = {request_id: 3 if int(request_id) % 2 == 0 else 1 for request_id in prompts}
    # 4 seats: an n=3 request runs beside an n=1 one; 16 blocks are too few for both.
    engine = make_tiny_engine(max_num_seqs=4, num_gpu_blocks_override=16, max_model_len=32)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt},
                           SamplingParams(n=num_samples[request_id], **greedy))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.scheduler.num_running <= 4
        engine.kv_cache_manager.block_pool.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    reference = make_tiny_engine(enable_prefix_caching=False)
    for request_id, prompt in prompts.items():
        expected = samples(reference, prompt, SamplingParams(**greedy), request_id)
        assert [c.token_ids for c in finals[request_id].outputs] == expected * num_samples[request_id]
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


# ------------------------------------------------------------------------------------------ beams
def hf_beam_search(model, prompt: list[int], params: BeamSearchParams, eos_token_id) -> list[tuple[list[int], float]]:
    """``transformers`` beam search: (prompt + generated tokens without padding, score), best first."""
    output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            num_beams=params.beam_width, num_return_sequences=params.beam_width,
                            do_sample=False, early_stopping=False, length_penalty=params.length_penalty,
                            max_new_tokens=params.max_tokens, eos_token_id=eos_token_id,
                            pad_token_id=eos_token_id if eos_token_id is not None else 0,
                            output_scores=True, return_dict_in_generate=True)
    results = []
    for sequence, score in zip(output.sequences.tolist(), output.sequences_scores.tolist()):
        generated = sequence[len(prompt):]
        if eos_token_id in generated:
            generated = generated[:generated.index(eos_token_id) + 1]
        results.append((prompt + generated, score))
    return results


def assert_same_beams(ours, theirs) -> None:
    assert [s.tokens for s in ours.sequences] == [tokens_ for tokens_, _ in theirs]
    for sequence, (_, score) in zip(ours.sequences, theirs):
        assert sequence.score == pytest.approx(score, rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_hf_model():
    pytest.importorskip("transformers")
    return hf_tiny_model(seed=0)  # make_tiny_engine's weights


@pytest.mark.parametrize("beam_width,length_penalty,with_eos", [(3, 1.0, False), (4, 0.6, True), (2, 2.0, True)])
def test_beam_search_equals_transformers_tiny(tiny_hf_model, beam_width, length_penalty, with_eos):
    rng = random.Random(beam_width)
    prompts = [tokens(rng, n) for n in (3, 7, 13)]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=10, length_penalty=length_penalty)
    engine = make_tiny_engine(max_num_batched_tokens=16)
    eos_token_id = None
    if with_eos:
        # A token that the best beam of the second prompt produces third: beams do end early.
        best = beam_search(engine, prompts[1:2], params)[0].sequences[0].tokens
        eos_token_id = best[len(prompts[1]) + 2]
        engine.eos_token_id = eos_token_id
    outputs = beam_search(engine, prompts, params)
    kv = engine.kv_cache_manager
    assert kv.block_pool.num_used_blocks == 0 and kv.num_copies > 0
    kv.block_pool.check_invariants()
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            assert_same_beams(output, hf_beam_search(tiny_hf_model, prompt, params, eos_token_id))
    if with_eos and length_penalty < 1.0:  # a strong length reward may outrank every early end
        assert any(s.finish_reason == "stop" for o in outputs for s in o.sequences)


def test_beams_share_blocks():
    rng = random.Random(9)
    prompt = tokens(rng, 6 * BLOCK)
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    engine = make_tiny_engine()
    pool = engine.kv_cache_manager.block_pool
    peak = 0
    original = engine.model_runner.execute_model

    def spy(*args):
        nonlocal peak
        peak = max(peak, pool.num_used_blocks)
        pool.check_invariants()
        return original(*args)

    engine.model_runner.execute_model = spy
    beam_search(engine, [prompt], params)
    unshared = 4 * -(-(len(prompt) + params.max_tokens) // BLOCK)
    # The 6 prompt blocks are held once; each beam owns at most its ~4 generated blocks.
    assert 6 < peak <= 6 + 4 * 4 < unshared
    assert pool.num_used_blocks == 0


def test_beam_search_rejects_what_cannot_run():
    engine = make_tiny_engine(max_num_seqs=4, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="beam_width=8 is larger than max_num_seqs=4"):
        beam_search(engine, [[1, 2]], BeamSearchParams(beam_width=8, max_tokens=4))
    with pytest.raises(ValueError, match="needs up to 40 KV blocks"):
        beam_search(engine, [[1] * 20], BeamSearchParams(beam_width=4, max_tokens=20))
    with pytest.raises(ValueError, match="exceeds max_model_len=128"):
        beam_search(engine, [[1] * 120], BeamSearchParams(beam_width=1, max_tokens=9))
    for bad in (dict(beam_width=0, max_tokens=1), dict(beam_width=1, max_tokens=0),
                dict(beam_width=1, max_tokens=1, length_penalty=float("nan"))):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


@pytest.mark.slow
def test_beam_search_equals_transformers_smollm2(smollm2_llm_fp32):
    transformers = pytest.importorskip("transformers")
    from pagedllm.models.loader import model_folder, resolve_model_path

    llm = smollm2_llm_fp32
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_folder(resolve_model_path(None))),
                                                       dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.eos_token_id
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode("def fibonacci(n):"),
               llm.encode_chat([{"role": "user", "content": "Say hi."}])]
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.8)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            assert_same_beams(output, hf_beam_search(hf, prompt, params, eos))
    assert outputs[0].sequences[0].text.startswith("The capital of France is")
