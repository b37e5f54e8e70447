"""Speculative decoding (docs/speculative-decoding.md): proposers against brute-force
references, greedy output against non-speculative decoding (tiny llama) and transformers
(SmolLM2), rollback invariants, the sampled distribution against non-speculative sampling
(chi-square), metrics and refusals.
"""

from __future__ import annotations

import argparse
import functools
import random
from collections import Counter

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import SchedulerStats
from pagedllm.metrics import EngineMetrics
from pagedllm.models.loader import build_model
from pagedllm.spec_decode.ngram_proposer import propose_ngram
from pagedllm.spec_decode.suffix_proposer import SuffixProposer
from pagedllm.core.request import Request
from pagedllm.core.scheduled_batch import SamplingInput
from pagedllm.worker.rejection_sampler import rejection_sample
from pagedllm.worker.sampler import SamplingMetadata, process_logits, sampling_probs
from tests.conftest import make_tiny_engine, run_to_completion, tiny_config, tiny_state_dict

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
PROPOSERS = {"ngram": NGRAM, "suffix": SUFFIX}


# ----------------------------------------------------------------------------- proposers
def ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: the longest suffix match (n in [min_n, max_n]), latest position on a tie."""
    best = None
    for end in range(len(tokens) - 1):  # tokens[end] is the last token of an earlier occurrence
        length = 0
        while (length < max_n and end - length >= 0 and length < len(tokens)
               and tokens[end - length] == tokens[len(tokens) - 1 - length]):
            length += 1
        if length >= min_n and (best is None or length >= best[0]):
            best = (length, end)
    return [] if best is None else tokens[best[1] + 1:best[1] + 1 + k]


def test_ngram_proposer_equals_brute_force():
    rng = random.Random(0)
    num_nonempty = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        expected = ngram_reference(tokens, min_n, max_n, k)
        assert propose_ngram(tokens, min_n, max_n, k) == expected, (tokens, min_n, max_n, k)
        num_nonempty += bool(expected)
    assert 100 < num_nonempty < 400


def suffix_reference(tokens: list[int], depth: int, factor: float, min_prob: float, k: int) -> list[int]:
    """Brute force over substring counts. For each suffix (<= depth tokens) seen before with a
    continuation: follow the most frequent next token (first seen on a tie) while the product of
    frequencies stays >= min_prob, at most min(k, factor x suffix length) tokens and depth tokens
    with the suffix; score = sum of those products. The best score wins, the longer suffix on a tie."""
    def count(pattern: tuple) -> int:
        n = len(pattern)
        return sum(tuple(tokens[i:i + n]) == pattern for i in range(len(tokens) - n + 1))

    def continuations(pattern: tuple) -> dict:
        n, found = len(pattern), {}
        for i in range(len(tokens) - n):
            if tuple(tokens[i:i + n]) == pattern and tokens[i + n] not in found:
                found[tokens[i + n]] = count(pattern + (tokens[i + n],))
        return found

    best, best_score = [], 0.0
    for length in range(1, min(len(tokens), depth) + 1):
        pattern = tuple(tokens[-length:])
        draft, probability, score = [], 1.0, 0.0
        while len(draft) < min(k, int(factor * length + 1e-6)) and len(pattern) < depth:
            options = continuations(pattern)
            if not options:
                break
            token = max(options, key=options.get)
            probability *= options[token] / sum(options.values())
            if probability < min_prob:
                break
            draft.append(token)
            score += probability
            pattern += (token,)
        if draft and score >= best_score:
            best, best_score = draft, score
    return best


def test_suffix_proposer_equals_brute_force():
    rng = random.Random(1)
    num_nonempty = 0
    for case in range(300):
        depth, k = rng.randrange(3, 9), rng.randrange(1, 5)
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.5])
        proposer = SuffixProposer(depth, factor, min_prob)
        request = Request(f"r{case}", [rng.randrange(3) for _ in range(rng.randrange(1, 12))],
                          SamplingParams(), 100, None)
        for _ in range(rng.randrange(1, 25)):  # grown step by step, as the engine does
            expected = suffix_reference(request.all_token_ids, depth, factor, min_prob, k)
            assert proposer.propose(request, k) == expected, (request.all_token_ids, depth, factor, min_prob, k)
            num_nonempty += bool(expected)
            request.output_token_ids.append(rng.randrange(3))
        proposer.remove(request.request_id)
    assert num_nonempty > 500
    assert not proposer._tries


def test_suffix_proposer_takes_a_huge_spec_factor():
    """A finite factor whose product with the match length overflows to inf (the breaker's
    1e308) bounds nothing: drafts are num_speculative_tokens long, no OverflowError."""
    SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_spec_factor": 1e308})
    request = Request("r", [1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams(), 100, None)
    assert SuffixProposer(24, 1e308, 0.0).propose(request, 2) == [4, 5]


# ----------------------------------------------------------------------------- greedy equality
def spec_engine(config: dict | None, **kwargs) -> LLMEngine:
    return make_tiny_engine(speculative_config=config, **kwargs)


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that drafts exist from the first steps."""
    rng = random.Random(2)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(1, 256) for _ in range(rng.randrange(2, 6))]
        prompts.append((phrase * 8)[:rng.randrange(6, 30)])
    return prompts


def step_checking_rollback(engine, extra_check=None) -> dict:
    """Step to the end, checking ``check_rollback_invariants`` (and ``extra_check(engine)``)
    after every step; the final ``RequestOutput`` by request id."""
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        check_rollback_invariants(engine)
        if extra_check is not None:
            extra_check(engine)
    return finals


def check_rollback_invariants(engine: LLMEngine) -> None:
    """No block holds only rejected slots; every cached block's key is over accepted tokens."""
    manager = engine.kv_cache_manager
    manager.block_pool.check_invariants()
    block_size = manager.block_size
    for request in engine.scheduler.running:
        blocks = manager.req_to_blocks.get(request.request_id, [])
        assert len(blocks) <= manager.num_blocks_needed(request.num_tokens), request
        assert request.num_computed_tokens <= request.num_tokens
        tokens = request.all_token_ids
        for index, block in enumerate(blocks):
            if block.block_hash is not None:
                assert block.block_hash.token_ids == tuple(tokens[index * block_size:(index + 1) * block_size])
                assert (index + 1) * block_size <= request.num_computed_tokens


def run_checked(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> dict:
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    finals = step_checking_rollback(engine)
    manager = engine.kv_cache_manager
    assert manager.block_pool.num_used_blocks == 0 and not manager.req_to_blocks
    return finals


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_greedy_output_equals_non_speculative(method):
    prompts = repetitive_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 7 * i, ignore_eos=True) for i in range(6)]
    base = spec_engine(None)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        base.add_request(f"r{i}", prompt, param)
    expected = run_to_completion(base)
    config = dict(PROPOSERS[method], disable_by_batch_size=None)
    engine = spec_engine(config)
    finals = run_checked(engine, prompts, params)
    for i in range(6):
        a, b = expected[f"r{i}"].outputs[0], finals[f"r{i}"].outputs[0]
        assert b.token_ids == a.token_ids, i
        # No request asks for logprobs: the verification takes only each row's log-normalizer.
        assert a.cumulative_logprob < -1.0
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4), i
    stats = engine.make_stats()
    # Both paths ran: drafts accepted and drafts rejected (rolled back).
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def run_to_completion_outputs(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list:
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    finals = run_to_completion(engine)
    return [finals[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_greedy_equal_with_eos_logprobs_n2_penalties_and_preemption():
    """EOS inside accepted drafts, logprobs of every token, n=2, a penalized request (which gets
    no drafts) and preemption by a pool too small for all: outputs, logprobs and finish
    reasons equal non-speculative decoding."""
    prompts = repetitive_prompts(5)
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, n=2),
              SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=35)]
    options = dict(num_gpu_blocks_override=24, max_model_len=80, max_num_seqs=8)
    # The tiny model's most frequent output token serves as EOS, so that some request stops
    # on it inside a run of accepted drafts.
    eos = Counter(t for tokens in run_to_completion_outputs(spec_engine(None, **options), prompts, params)
                  for t in tokens).most_common(1)[0][0]

    def run(config):
        engine = spec_engine(config, **options)
        finals = run_checked_with_eos(engine, prompts, params, eos)
        return engine, finals

    base_engine, base = run(None)
    assert base_engine.scheduler.num_preemptions > 0
    engine, spec = run(dict(NGRAM, disable_by_batch_size=None))
    assert engine.scheduler.num_preemptions > 0 and engine.make_stats().spec_decode_num_accepted_tokens > 0
    assert any(o.outputs[0].finish_reason == "stop" for o in base.values())
    for request_id, output in base.items():
        other = spec[request_id]
        for a, b in zip(output.outputs, other.outputs, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), request_id
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
            if a.logprobs is not None:
                assert [list(d) for d in a.logprobs] == [list(d) for d in b.logprobs]
                assert [x.logprob for d in a.logprobs for x in d.values()] == pytest.approx(
                    [x.logprob for d in b.logprobs for x in d.values()], abs=1e-4)


def run_checked_with_eos(engine: LLMEngine, prompts: list, params: list, eos: int) -> dict:
    """``run_checked`` with every request's EOS set to ``eos``."""
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
        for child in engine.parents[f"r{i}"].children:
            child.eos_token_id = eos
    finals = step_checking_rollback(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    return finals


# ----------------------------------------------------------------------------- distribution
def chi_square_p_value(observed: list[float], expected: list[float]) -> float:
    """Pearson's test of counts against expected counts (bins with expectation 0 must be empty)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    df = sum(e > 0 for e in expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two equal-size samples come from one distribution (outcomes seen
    fewer than 10 times in both together are pooled into one bin)."""
    a, b = Counter(a), Counter(b)
    for key in [k for k in set(a) | set(b) if a[k] + b[k] < 10]:
        a["rare"] += a.pop(key, 0)
        b["rare"] += b.pop(key, 0)
    keys = [k for k in set(a) | set(b) if a[k] + b[k] > 0]
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return float(torch.special.gammaincc(torch.tensor((len(keys) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_rejection_sampler_emits_the_target_distribution():
    """Each emitted token is distributed as the target row it was drawn at (temperature and
    top-p applied), whatever the drafts: a likely draft, an unlikely one, one outside top-p."""
    vocab, draws = 6, 12000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.95)
    request = SamplingInput("r", params, prompt_token_ids=[1])
    meta_one = SamplingMetadata.build([request] * 3, vocab)
    target = sampling_probs(process_logits(logits, meta_one), meta_one)
    for drafts in ([int(target[0].argmax()), int(target[1].argmax())],
                   [int(target[0].argsort()[-3]), int(target[1].argmin())]):
        meta = SamplingMetadata.build([request] * (3 * draws), vocab)
        emitted = rejection_sample(logits.repeat(draws, 1), meta, [drafts] * draws,
                                   torch.Generator().manual_seed(4))
        first = Counter(tokens[0] for tokens in emitted)
        assert chi_square_p_value([first[t] for t in range(vocab)], (target[0] * draws).tolist()) > 1e-3
        # A token whose first draft was accepted: its second token is drawn from row 1.
        after = [tokens[1] for tokens in emitted if len(tokens) > 1]
        second = Counter(after)
        assert len(after) > 1000
        assert chi_square_p_value([second[t] for t in range(vocab)], (target[1] * len(after)).tolist()) > 1e-3
        # The test has power: the first tokens are far from the second row's distribution.
        assert chi_square_p_value([first[t] for t in range(vocab)], (target[1] * draws).tolist()) < 1e-6


@functools.lru_cache(maxsize=1)
def small_vocab_model():
    config = tiny_config(vocab_size=8)
    return build_model(config, tiny_state_dict(config, seed=5), torch.float32)


def sample_sequences(config: dict | None, num_requests: int) -> Counter:
    args = EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=2048, max_model_len=64, max_num_seqs=256,
                                  max_num_batched_tokens=1024, speculative_config=config)
    engine = LLMEngine(args, model=small_vocab_model(), tokenizer=None)
    # The model's own greedy path, twice: prompt lookup then drafts what the model tends to
    # say, and temperature 1.5 leaves a fair chance to reject them.
    engine.add_request("greedy", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    path = [1, 2, 3] + run_to_completion(engine)["greedy"].outputs[0].token_ids
    # Samples of n > 1 requests: the prompt is computed once per request (sample i of request
    # r draws from seed r + i).
    for r in range(0, num_requests, 200):
        engine.add_request(f"r{r}", (path * 2)[:-4],
                           SamplingParams(n=200, temperature=1.5, max_tokens=4, ignore_eos=True, seed=r * 1000))
    finals = run_to_completion(engine)
    if config is not None:
        stats = engine.make_stats()
        assert stats.spec_decode_num_drafts > num_requests // 2, stats
        assert 0.2 < stats.spec_decode_acceptance_rate < 0.9, stats
    return Counter(tuple(sample.token_ids) for output in finals.values() for sample in output.outputs)


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_sampled_sequences_have_the_non_speculative_distribution(method):
    """800 seeded 4-token samples of an 8-token-vocabulary model, with and without drafts (3
    per step): each position's token and the pair (second, third) have the same distribution
    (two-sample chi-square)."""
    num = 800
    plain = sample_sequences(None, num)
    spec = sample_sequences(dict(PROPOSERS[method], num_speculative_tokens=3, disable_by_batch_size=None), num)

    def project(counts: Counter, index) -> Counter:
        projected = Counter()
        for tokens, count in counts.items():
            projected[index(tokens)] += count
        return projected

    for index in (0, 1, 2, 3, slice(1, 3)):
        assert two_sample_p_value(project(plain, lambda t: t[index]), project(spec, lambda t: t[index])) > 1e-3, index


# ----------------------------------------------------------------------------- SmolLM2
_EDIT_PROMPT = ("Rename the variables of this function to snake_case and keep everything else:\n\n"
                "def computeTotal(itemList, taxRate):\n"
                "    totalValue = 0\n"
                "    for currentItem in itemList:\n"
                "        totalValue += currentItem.price * currentItem.quantity\n"
                "    totalValue = totalValue * (1 + taxRate)\n"
                "    return totalValue\n\n"
                "Answer:\n\ndef compute_total(")


@pytest.fixture(scope="module")
def smollm2(smollm2_llm_fp32):
    return smollm2_llm_fp32.llm_engine


def smollm2_engine(base: LLMEngine, config: dict | None, kv_cache_memory_bytes: int = 64 * 2**20) -> LLMEngine:
    args = EngineArgs.from_kwargs(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                  speculative_config=config)
    return LLMEngine(args, model=base.model, tokenizer=base.tokenizer)


@pytest.fixture(scope="module")
def edit_reference(smollm2) -> tuple[list[int], list[int]]:
    """The edit prompt's tokens and transformers' greedy fp32 continuation (32 tokens)."""
    from transformers import LlamaForCausalLM

    from pagedllm.models.loader import model_folder, resolve_model_path
    from tests.test_parity import hf_greedy

    prompt = smollm2.tokenizer.encode(_EDIT_PROMPT)
    hf = LlamaForCausalLM.from_pretrained(str(model_folder(resolve_model_path(None))), dtype=torch.float32)
    return prompt, hf_greedy(hf.eval(), prompt, 32)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_smollm2_greedy_equals_transformers(smollm2, edit_reference, method):
    """SmolLM2 fp32 rewriting a function: greedy output with drafts equals transformers'
    greedy decoding token for token (drafts were accepted and rejected)."""
    prompt, expected = edit_reference
    engine = smollm2_engine(smollm2, PROPOSERS[method])
    engine.add_request("edit", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert run_to_completion(engine)["edit"].outputs[0].token_ids == expected
    stats = engine.make_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.slow
def test_smollm2_stop_string_output_equals_non_speculative(smollm2):
    """With a stop string, SmolLM2's output with drafts ends where one token at a time ends
    it: same text, tokens, finish and stop reason."""
    plain = smollm2_engine(smollm2, None)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain.add_request("full", _EDIT_PROMPT, params)
    text = run_to_completion(plain)["full"].outputs[0].text
    # A stop string that first occurs in the middle of the output.
    start, length = len(text) // 2, 4
    while text.find(text[start:start + length]) < start:
        length += 1
    stop = text[start:start + length]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    outputs = []
    for config in (None, NGRAM):
        engine = smollm2_engine(smollm2, config)
        engine.add_request("stop", _EDIT_PROMPT, params)
        outputs.append(run_to_completion(engine)["stop"].outputs[0])
    assert engine.make_stats().spec_decode_num_accepted_tokens > 0
    (a, b) = outputs
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason, b.stop_reason)
    assert a.finish_reason == "stop" and len(a.token_ids) < 32


def smollm2_draft_engine(base: LLMEngine, quantization: str | None = None) -> LLMEngine:
    """An engine over ``base``'s model with SmolLM2 (read again, as ``quantization`` says) as
    its draft model; the doubled KV budget holds a max_model_len request in both pools."""
    from pagedllm.models.loader import resolve_model_path

    config = {"model": str(resolve_model_path(None)), "quantization": quantization, "num_speculative_tokens": 4}
    return smollm2_engine(base, config, kv_cache_memory_bytes=128 * 2**20)


@pytest.mark.slow
def test_smollm2_drafting_for_itself_accepts_every_draft(smollm2, edit_reference):
    """SmolLM2 fp32 drafting for itself proposes the target's own greedy tokens: every draft
    is accepted, and the output equals transformers' greedy decoding token for token."""
    prompt, expected = edit_reference
    engine = smollm2_draft_engine(smollm2)
    engine.add_request("edit", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert run_to_completion(engine)["edit"].outputs[0].token_ids == expected
    stats = engine.make_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0, stats
    assert engine.proposer.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.slow
def test_smollm2_int4_draft_for_the_fp32_model_equals_transformers(smollm2, edit_reference):
    """SmolLM2's int4 variant (the GGUF's 4-bit codes) drafting for the fp32 model: the
    output equals transformers' greedy decoding, drafts accepted."""
    prompt, expected = edit_reference
    engine = smollm2_draft_engine(smollm2, "int4")
    assert engine.proposer.model.quantization == "int4"
    engine.add_request("edit", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert run_to_completion(engine)["edit"].outputs[0].token_ids == expected
    stats = engine.make_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens, stats
    assert engine.proposer.kv_cache_manager.block_pool.num_used_blocks == 0


# ----------------------------------------------------------------------------- options, refusals
def test_speculative_config_is_checked():
    assert EngineArgs.from_kwargs(speculative_config=NGRAM).speculative.prompt_lookup_max == 3
    parsed = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3}')
    assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (3, 3)  # vLLM's rule
    parsed = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (5, 5)
    # vLLM's rule: no method is ngram, or draft_model when a model is given.
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_dict({"model": "some/model", "num_speculative_tokens": 2}).method == "draft_model"
    # vLLM's rule: suffix decoding bounds its drafts by the trie's depth unless told otherwise.
    assert SpeculativeConfig.from_dict({"method": "suffix"}).num_speculative_tokens == 24
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 9}).num_speculative_tokens == 9
    refused = {
        "'draft_model' needs model": {"method": "draft_model", "num_speculative_tokens": 3},
        "method 'ngram' takes neither": {"method": "ngram", "model": "some/model", "num_speculative_tokens": 3},
        "quantization must be one of": {"model": "some/model", "quantization": "int3", "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "num_speculative_tokens": 3},
        "unsupported field": {"method": "ngram", "num_speculative_tokens": 3, "speculative_token_tree": "x"},
        "num_speculative_tokens must be a positive": {"method": "ngram", "num_speculative_tokens": 0},
        "num_speculative_tokens must be a positive integer, got None": {"method": "ngram"},
        "prompt_lookup_min \\(4\\) must be <=": {"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "min_token_prob": {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
        "max_spec_factor must be a finite number > 0, got inf": {"method": "suffix",
                                                                 "suffix_decoding_max_spec_factor": float("inf")},
        "max_spec_factor must be a finite number > 0, got True": {"method": "suffix",
                                                                  "suffix_decoding_max_spec_factor": True},
        "min_token_prob must be in \\[0, 1\\], got True": {"method": "suffix", "suffix_decoding_min_token_prob": True},
        "not valid JSON": "{method: ngram}",
    }
    for message, config in refused.items():
        with pytest.raises(ValueError, match=message):
            EngineArgs.from_kwargs(speculative_config=config)


def test_cli_flag_and_serve_parser():
    from pagedllm.entrypoints.cli import build_parser

    flag = ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}']
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(flag)).speculative.method == "suffix"
    serve = build_parser().parse_args(["serve", *flag])
    assert EngineArgs.from_cli_args(serve).speculative_config == {"method": "suffix", "num_speculative_tokens": 3}


def test_beam_search_is_refused():
    from pagedllm.beam_search import BeamSearchParams, beam_search

    with pytest.raises(ValueError, match="speculative_config"):
        beam_search(spec_engine(NGRAM), [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=4))


def test_no_drafts_when_more_sequences_run_than_disable_by_batch_size():
    for threshold, expect_drafts in ((2, False), (3, True)):
        engine = spec_engine(dict(NGRAM, disable_by_batch_size=threshold))
        for i, prompt in enumerate(repetitive_prompts(3)):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10))
        engine.step()  # three prompts in: three running
        assert len(engine.scheduler.running) == 3
        assert bool(engine.scheduler.spec_decode_candidates()) == expect_drafts
        if not expect_drafts:
            assert not any(r.spec_token_ids for r in engine.scheduler.running)


# ----------------------------------------------------------------------------- metrics
def run_counting_drafts(engine, num_prompts: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Run ``num_prompts`` repetitive greedy prompts to the end; returns the drafts each step
    scheduled (one list per verifying request) and the number each verification accepted."""
    scheduled_drafts, accepted = [], []
    schedule, execute = engine.scheduler.schedule, engine.model_runner.execute_model

    def schedule_spy(*args, **kwargs):
        output = schedule(*args, **kwargs)
        scheduled_drafts.extend(output.scheduled_spec_decode_tokens.values())
        return output

    def execute_spy(*args, **kwargs):
        output = execute(*args, **kwargs)
        accepted.extend(output.num_accepted_tokens.values())
        return output

    engine.scheduler.schedule, engine.model_runner.execute_model = schedule_spy, execute_spy
    run_to_completion_outputs(engine, repetitive_prompts(num_prompts),
                              [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * num_prompts)
    return scheduled_drafts, accepted


def test_counters_count_what_ran_and_reach_prometheus():
    """The engine's counters equal what the scheduler scheduled and the sampler accepted; the
    Prometheus series (vLLM's names) follow the snapshots."""
    engine = spec_engine(dict(NGRAM, disable_by_batch_size=None))
    scheduled_drafts, accepted = run_counting_drafts(engine, 4, max_tokens=30)
    stats = engine.make_stats()
    assert stats.spec_decode_num_drafts == len(scheduled_drafts) > 0
    assert stats.spec_decode_num_draft_tokens == sum(map(len, scheduled_drafts))
    assert stats.spec_decode_num_accepted_tokens == sum(accepted) > 0
    counters = engine.make_kv_snapshot().to_dict()["counters"]  # what /dashboard shows
    assert counters["spec_decode_acceptance_rate"] == stats.spec_decode_acceptance_rate

    metrics = EngineMetrics("m", 128, 16, 64, log_interval=None)
    metrics.update_gauges(stats)
    metrics.update_gauges(SchedulerStats(spec_decode_num_drafts=stats.spec_decode_num_drafts + 2,
                                         spec_decode_num_draft_tokens=stats.spec_decode_num_draft_tokens + 7,
                                         spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens + 5))
    text = metrics.render().decode()
    for name, value in (("spec_decode_num_drafts", stats.spec_decode_num_drafts + 2),
                        ("spec_decode_num_draft_tokens", stats.spec_decode_num_draft_tokens + 7),
                        ("spec_decode_num_accepted_tokens", stats.spec_decode_num_accepted_tokens + 5)):
        for prefix in ("vllm", "pagedllm"):
            assert f'{prefix}:{name}_total{{model_name="m"}} {float(value)}' in text, (prefix, name)


def test_served_engine_exports_the_counters():
    """``/v1/completions`` on an engine with drafts: ``/metrics`` carries the counters under
    vLLM's names and pagedllm's."""
    import httpx

    from tests.test_server import InThreadServer, idle, wait_for_metrics

    body = {"prompt": repetitive_prompts(1)[0], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with InThreadServer(spec_engine(NGRAM)) as server:
        result = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        values = wait_for_metrics(server.url, idle)
    assert result["usage"]["completion_tokens"] == 24
    drafts = values["vllm:spec_decode_num_draft_tokens_total"]
    accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < drafts and values["vllm:spec_decode_num_drafts_total"] > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert values[f"pagedllm:spec_decode_{name}_total"] == values[f"vllm:spec_decode_{name}_total"]


class _TokenTextTokenizer:
    """Token ``i`` reads ``<i>``: enough of a tokenizer for the detokenizer's stop strings."""

    all_special_ids: list = []
    added_tokens_decoder: dict = {}

    def __len__(self) -> int:
        return 256

    def convert_ids_to_tokens(self, token_ids):
        return [f"<{i}>" for i in token_ids]

    def convert_tokens_to_string(self, tokens) -> str:
        return "".join(tokens)


def test_stop_string_completed_inside_accepted_drafts_drops_the_tokens_after_it():
    """A stop string completed by an accepted draft, not the last token of its step: the
    tokens the step gave after it are dropped, and the output (tokens, text, finish and stop
    reason) equals one-token-at-a-time decoding."""
    prompt = repetitive_prompts(1)[0]

    def run(config, stop):
        engine = spec_engine(config)
        # Prompts stay token ids; only stop strings need the text.
        engine.input_processor.tokenizer = engine.output_processor.tokenizer = _TokenTextTokenizer()
        steps = []
        process_tokens = engine._process_tokens

        def spy(request, token_ids):
            steps.append(list(token_ids))
            return process_tokens(request, token_ids)

        engine._process_tokens = spy
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop)
        engine.add_request("r", prompt, params)
        return run_to_completion(engine)["r"].outputs[0], steps

    _, steps = run(NGRAM, None)
    output = [t for step in steps for t in step]

    def first_end(pattern: list[int]) -> int:
        return next(i + len(pattern) - 1 for i in range(len(output)) if output[i:i + len(pattern)] == pattern)

    # The shortest run of tokens whose first occurrence ends inside a multi-token step, before
    # that step's last token (accepted drafts repeat earlier text, so it spans back before
    # the drafts that were copied).
    candidates = []
    position = 0
    for step in steps:
        for end in range(position, position + len(step) - 1):
            length = next((n for n in range(1, end + 2) if first_end(output[end - n + 1:end + 1]) == end), None)
            if length is not None:
                candidates.append((length, end))
        position += len(step)
    length, end = min(candidates)
    stop = ["".join(f"<{t}>" for t in output[end - length + 1:end + 1])]
    (plain, _), (spec, spec_steps) = run(None, stop), run(NGRAM, stop)
    assert (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason) == \
        (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason)
    assert spec.finish_reason == "stop" and spec.token_ids == output[:end + 1]
    assert sum(map(len, spec_steps)) > len(spec.token_ids)  # tokens after the stop were dropped
