"""SamplingParams validation, the batched sampler against straightforward references, and the
engine's sampling features on the tiny random llama (B11, B12, B18 seeded and penalty parts)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core.scheduled_batch import SamplingInput
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.worker.sampler import SamplingMetadata, process_logits, sample
from tests.conftest import TINY_VOCAB, make_tiny_engine, run_to_completion


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", -1), ("max_tokens", 2.5),
    ("min_tokens", -1), ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 100), ("stop", [""]),
    ("stop", 5), ("stop_token_ids", [-1]), ("allowed_token_ids", []), ("logit_bias", {1: float("inf")}),
    ("logit_bias", {"x": 1.0}), ("bad_words", "word"), ("seed", 1.0), ("ignore_eos", 1),
    ("output_kind", "delta"),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})


def test_logprobs_minus_one_says_the_whole_vocabulary_is_over_the_limit():
    """vLLM reads ``logprobs=-1`` as the whole vocabulary, refused under its default
    ``max_logprobs=20``; found by the fresh-user check, the message now says so."""
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{field}=-1 asks for the whole vocabulary, more than the 20 "):
            SamplingParams(**{field: -1})


def test_b11_max_tokens_edge_cases_validated():
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -3"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="max_tokens must be an integer, got 1.5"):
        SamplingParams(max_tokens=1.5)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens=2, got 5"):
        SamplingParams(max_tokens=2, min_tokens=5)
    params = SamplingParams(stop="x", logit_bias={"7": -1})
    assert params.stop == ["x"] and params.logit_bias == {7: -1.0}


def test_out_of_vocab_ids_rejected_by_engine():
    engine = make_tiny_engine()
    for kwargs in ({"stop_token_ids": [TINY_VOCAB]}, {"allowed_token_ids": [1, TINY_VOCAB + 5]},
                   {"logit_bias": {TINY_VOCAB: 1.0}}):
        with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {TINY_VOCAB}\\)"):
            engine.add_request("r", [1, 2], SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request("r", [1, 2], SamplingParams(stop=["x"]))
    assert not engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- distributions
def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> list[float]:
    """The filtered softmax, written out token by token from the definitions."""
    scaled = [x / temperature for x in logits.tolist()]
    peak = max(scaled)
    probs = [math.exp(x - peak) for x in scaled]
    total = sum(probs)
    probs = [p / total for p in probs]
    keep = set(range(len(probs)))
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    order = sorted(keep, key=lambda i: -probs[i])
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1:
        mass = sum(probs[i] for i in order)
        kept, cumulative = [], 0.0
        for i in order:
            kept.append(i)
            cumulative += probs[i] / mass
            if cumulative >= top_p:
                break
        order = kept
    mass = sum(probs[i] for i in order)
    return [probs[i] / mass if i in order else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 6, 0.9, 0.05),
])
def test_sampling_frequencies_match_filtered_softmax(temperature, top_k, top_p, min_p):
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    requests = [SamplingInput(str(i), params, prompt_token_ids=[0]) for i in range(draws)]
    meta = SamplingMetadata.build(requests, vocab)
    tokens = sample(logits.expand(draws, vocab), meta, torch.Generator().manual_seed(0)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    expected = _reference_probs(logits, temperature, top_k, top_p, min_p)
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, (token, count)
        else:
            # Five standard deviations of a binomial count.
            assert abs(count / draws - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (token, count / draws, p)


def test_windowed_top_k_top_p_equals_full_sort():
    """The fast path (``topk`` window of TOP_P_CANDIDATES tokens, fallback for flat rows)
    masks exactly what a full sort of the vocabulary masks."""
    from pagedllm.worker.sampler import TOP_P_CANDIDATES, _top_k_top_p_by_sort, apply_top_k_top_p
    generator = torch.Generator().manual_seed(2)
    vocab, rows = 4 * TOP_P_CANDIDATES, 8
    # Peaked rows (nucleus inside the window) and flat rows (it is not).
    scale = torch.tensor([8.0, 6.0, 0.1, 0.5, 8.0, 0.1, 6.0, 3.0]).unsqueeze(1)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.99, 1.0, 0.3, 0.95, 0.8])
    top_k = torch.tensor([vocab, 10, vocab, 3 * TOP_P_CANDIDATES, 50, vocab, TOP_P_CANDIDATES, 2])
    for k, p in ((None, top_p), (top_k, top_p), (top_k, None)):
        fast = apply_top_k_top_p(logits, k, p)
        reference = _top_k_top_p_by_sort(logits, k, p)
        assert torch.equal(torch.isinf(fast), torch.isinf(reference))
        assert torch.equal(fast[~torch.isinf(fast)], logits[~torch.isinf(fast)])


# ----------------------------------------------------------------------------- penalties
def _reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                         presence: float, frequency: float, repetition: float) -> list[float]:
    result = list(logits)
    for token in range(len(result)):
        if token in prompt or token in output:
            result[token] = result[token] / repetition if result[token] > 0 else result[token] * repetition
        count = output.count(token)
        result[token] -= frequency * count + (presence if count else 0.0)
    return result


def test_penalties_match_per_request_reference():
    rng = random.Random(3)
    vocab = 40
    requests, references = [], []
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * 3
    for row in range(6):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 15))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 25))]
        penalties = dict(presence_penalty=round(rng.uniform(-2, 2), 2),
                         frequency_penalty=round(rng.uniform(-2, 2), 2),
                         repetition_penalty=round(rng.uniform(0.5, 2.0), 2))
        if row == 5:
            penalties = {}  # a row without penalties shares the batch unchanged
        request = SamplingInput(str(row), SamplingParams(**penalties), prompt_token_ids=prompt, output_token_ids=output)
        requests.append(request)
        params = request.sampling_params
        references.append(_reference_penalties(logits[row].tolist(), prompt, output, params.presence_penalty,
                                               params.frequency_penalty, params.repetition_penalty))
    processed = process_logits(logits, SamplingMetadata.build(requests, vocab))
    torch.testing.assert_close(processed, torch.tensor(references), rtol=1e-5, atol=1e-5)


def test_masks_and_bias_match_reference():
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(9))
    allowed = SamplingParams(allowed_token_ids=[3, 7, 11], logit_bias={7: 2.5, 20: 4.0})
    min_tokens = SamplingParams(min_tokens=4, stop_token_ids=[5, 6])
    requests = [SamplingInput("a", allowed, None, [1], [], eos_token_id=2),
                SamplingInput("b", min_tokens, None, [1], [], eos_token_id=2),
                # min_tokens reached: nothing masked
                SamplingInput("c", SamplingParams(min_tokens=1, stop_token_ids=[5]), None, [1], [9], eos_token_id=2)]
    processed = process_logits(logits, SamplingMetadata.build(requests, vocab))
    expected = logits.clone()
    expected[0] = float("-inf")
    expected[0, [3, 7, 11]] = logits[0, [3, 7, 11]]
    expected[0, 7] += 2.5
    expected[1, [2, 5, 6]] = float("-inf")
    torch.testing.assert_close(processed, expected)


# ----------------------------------------------------------------------------- engine, tiny model
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _run(prompts, params, **engine_kwargs):
    engine = make_tiny_engine(**engine_kwargs)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params[index] if isinstance(params, list) else params)
    finals = run_to_completion(engine)
    return [finals[str(i)] for i in range(len(prompts))], engine


def test_b12_near_zero_temperature_and_top_p_are_greedy():
    prompts = [[5, 9, 17, 33], [100, 3]]
    greedy, _ = _run(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for params in (SamplingParams(max_tokens=12, temperature=1e-4, ignore_eos=True, seed=1),
                   SamplingParams(max_tokens=12, top_p=1e-4, ignore_eos=True, seed=1),
                   SamplingParams(max_tokens=12, temperature=1e-4, top_p=1e-4, ignore_eos=True)):
        outputs, _ = _run(prompts, params)
        for got, want in zip(outputs, greedy):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert math.isfinite(got.outputs[0].cumulative_logprob)


def test_b18_seeded_sampling_with_penalties_survives_preemption():
    """Seeded samples with penalties are the same with and without preemption. The reference
    runs the 8 requests in a pool that holds them all (seeded rows do not depend on the batch)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(4, 12))] for _ in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True,
                             presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.8)
              for i in range(8)]
    reference, engine = _run(prompts, params, max_model_len=64)
    assert engine.scheduler.num_preemptions == 0
    # 20 blocks of 4 tokens cannot hold 8 sequences of up to 36 tokens at once.
    preempted, engine = _run(prompts, params, num_gpu_blocks_override=20, max_model_len=64)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in preempted] == [o.outputs[0].token_ids for o in reference]


def test_logit_bias_allowed_tokens_and_min_tokens_in_engine():
    prompt = [7, 8, 9]
    free, _ = _run([prompt], SamplingParams(max_tokens=8, **GREEDY))
    first = free[0].outputs[0].token_ids[0]
    stopped, _ = _run([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first]))
    assert stopped[0].outputs[0].token_ids == [first] and stopped[0].outputs[0].stop_reason == first
    delayed, _ = _run([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first], min_tokens=3))
    tokens = delayed[0].outputs[0].token_ids
    assert len(tokens) > 3 and first not in tokens[:3]
    biased, _ = _run([prompt], SamplingParams(max_tokens=6, logit_bias={42: 100.0}, **GREEDY))
    assert biased[0].outputs[0].token_ids == [42] * 6
    allowed, _ = _run([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=3, allowed_token_ids=[4, 50, 99]))
    assert set(allowed[0].outputs[0].token_ids) <= {4, 50, 99}


def test_logprobs_are_raw_independent_of_k_and_finite():
    prompt = [11, 12, 13, 14, 15]
    results = {}
    for k in (1, 4, 10):
        for sampling in (dict(temperature=0.0), dict(temperature=0.5, top_p=0.9, seed=4)):
            out, _ = _run([prompt], SamplingParams(max_tokens=6, logprobs=k, prompt_logprobs=k,
                                                   ignore_eos=True, **sampling))
            results[(k, sampling["temperature"])] = out[0]
    for (k, temperature), output in results.items():
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            top = [t for t, lp in entry.items() if lp.rank <= k]
            assert len(top) == k and token in entry
            assert len(entry) == k + (entry[token].rank > k)
            assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in entry.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)), abs=1e-4)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    # Same tokens at temperature 0 whatever k; the values of shared tokens agree across k and
    # across sampling settings (raw logprobs), up to batch-shape float noise.
    reference = results[(10, 0.0)]
    for (k, temperature), output in results.items():
        for entries, ref_entries in ((output.prompt_logprobs[1:], reference.prompt_logprobs[1:]),
                                     (output.outputs[0].logprobs[:1], reference.outputs[0].logprobs[:1])):
            for entry, ref_entry in zip(entries, ref_entries):
                for token, lp in entry.items():
                    assert lp.logprob == pytest.approx(ref_entry[token].logprob, abs=1e-5)
                    assert lp.rank == ref_entry[token].rank
    for k in (1, 4):
        assert results[(k, 0.0)].outputs[0].token_ids == reference.outputs[0].token_ids


def test_b11_max_tokens_zero_returns_prompt_and_prompt_logprobs():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain, _ = _run([prompt], SamplingParams(max_tokens=0))
    assert plain[0].outputs[0].token_ids == [] and plain[0].outputs[0].finish_reason == "length"
    assert plain[0].prompt_token_ids == prompt
    echoed, _ = _run([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    generating, _ = _run([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert echoed[0].outputs[0].token_ids == []
    assert len(echoed[0].prompt_logprobs) == len(prompt)
    for got, want in zip(echoed[0].prompt_logprobs[1:], generating[0].prompt_logprobs[1:]):
        assert {t: round(lp.logprob, 4) for t, lp in got.items()} == \
            {t: round(lp.logprob, 4) for t, lp in want.items()}


def test_prompt_logprobs_with_chunked_prefill_and_prefix_cache():
    prompt = list(range(20, 70))
    whole, _ = _run([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))
    engine = make_tiny_engine(max_num_batched_tokens=16)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, **GREEDY))
    run_to_completion(engine)
    engine.add_request("chunked", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))
    chunked = run_to_completion(engine)["chunked"]
    assert len(chunked.prompt_logprobs) == len(prompt)
    for got, want in zip(chunked.prompt_logprobs[1:], whole[0].prompt_logprobs[1:]):
        assert list(got) == list(want)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)


def test_delta_and_final_only_output_kinds():
    prompt = [1, 2, 3]
    cumulative, _ = _run([prompt], SamplingParams(max_tokens=7, logprobs=2, **GREEDY))
    engine = make_tiny_engine()
    engine.add_request("d", prompt, SamplingParams(max_tokens=7, logprobs=2, output_kind=RequestOutputKind.DELTA,
                                                   **GREEDY))
    engine.add_request("f", prompt, SamplingParams(max_tokens=7, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY))
    deltas, finals = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            (deltas if output.request_id == "d" else finals).append(output)
    assert len(finals) == 1 and finals[0].finished
    assert finals[0].outputs[0].token_ids == cumulative[0].outputs[0].token_ids
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas) and deltas[-1].finished
    assert sum((d.outputs[0].token_ids for d in deltas), []) == cumulative[0].outputs[0].token_ids
    streamed = sum((d.outputs[0].logprobs for d in deltas), [])
    want = cumulative[0].outputs[0].logprobs
    assert [list(entry) for entry in streamed] == [list(entry) for entry in want]
    # Values agree up to the float noise of a different batch shape (MKL blocks a 1-row and a
    # 2-row matmul differently: ~5e-6 relative).
    assert [lp.logprob for e in streamed for lp in e.values()] == \
        pytest.approx([lp.logprob for e in want for lp in e.values()], rel=1e-5, abs=1e-5)


def test_b24_n_samples_are_independent_and_seeded_repeatable():
    prompt = [9, 8, 7, 6]
    for n in (2, 4):
        params = SamplingParams(n=n, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
        first, _ = _run([prompt], params)
        again, _ = _run([prompt], params)
        completions = first[0].outputs
        assert [c.index for c in completions] == list(range(n))
        samples = [tuple(c.token_ids) for c in completions]
        assert len(set(samples)) == n and all(len(s) == 10 for s in samples)
        assert [c.token_ids for c in again[0].outputs] == [list(s) for s in samples]


def test_bad_words_banning_every_allowed_token_is_a_value_error():
    """Found by the fresh-user check: allowed_token_ids=[" Paris"] with bad_words=[" Paris"]
    left no token to sample, and the sampler returned tokens outside the allowed set."""
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return {"Paris": [5], " Paris": [7], "Rome": [8, 9], " Rome": [10]}[text]

    params = SamplingParams(max_tokens=3, allowed_token_ids=[7], bad_words=[" Paris"])
    with pytest.raises(ValueError, match=r"ban every token of allowed_token_ids \[7\]"):
        params.tokenize_bad_words(Tokenizer())
    SamplingParams(max_tokens=3, allowed_token_ids=[7, 8], bad_words=["Paris"]).tokenize_bad_words(Tokenizer())
    multi = SamplingParams(max_tokens=3, allowed_token_ids=[8], bad_words=["Rome"])
    multi.tokenize_bad_words(Tokenizer())  # "Rome" is two tokens: 8 alone stays allowed
    assert multi._bad_words_token_ids == [[8, 9], [10]]
