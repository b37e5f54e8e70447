"""``kv_cache_dtype="bfloat16"`` under fp32 compute and ``kv_cache_dtype="int8"``: more blocks for
the same bytes, K/V rounded (or quantized) once when written, and every path (decode kernel,
prefill, chunked prefill, prefix cache, recompute after preemption) reading the same values."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.loader import build_model
from tests.conftest import TINY_VOCAB, run_to_completion, tiny_config, tiny_state_dict

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(kv_cache_dtype: str, head_dim: int = 64, **engine_kwargs) -> LLMEngine:
    """A tiny random llama with head_dim 64 (the decode kernel's AVX-512 path where the CPU has it)."""
    config = tiny_config(head_dim=head_dim, num_attention_heads=6, num_key_value_heads=2)
    model = build_model(config, tiny_state_dict(config, seed=3), torch.float32)
    kwargs = dict(block_size=4, num_gpu_blocks_override=128, max_model_len=256, max_num_seqs=16,
                  max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype)
    kwargs.update(engine_kwargs)
    return LLMEngine(EngineArgs.from_kwargs(**kwargs), model=model, tokenizer=None)


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy ``(token_ids, logprobs of those tokens)`` per prompt; checks no block leaks."""
    params = SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    results = []
    for i in range(len(prompts)):
        output = finals[str(i)].outputs[0]
        results.append((output.token_ids, [step[token].logprob for token, step in zip(output.token_ids, output.logprobs)]))
    return results


def assert_same(actual, expected) -> None:
    """Same tokens, and logprobs equal within 5e-3. Measured: a different chunking moves them
    by up to 1.2e-4 (1e-5 with a float32 cache: an fp32 difference in a projection can move a
    value across a bfloat16 rounding boundary), and by up to 1.05e-3 with an int8 cache, whose
    attention also rounds each query to int8 (one code apart after such a difference); prefill
    reading K/V that were not rounded, or a float32 cache, moves them by 0.04-0.06."""
    assert [tokens for tokens, _ in actual] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=5e-3)


def test_smaller_caches_hold_more_blocks():
    budget = 3 * 2**20
    blocks = {kv: make_engine(kv, num_gpu_blocks_override=None, kv_cache_memory_bytes=budget).num_blocks
              for kv in ("auto", "float32", "bfloat16", "int8")}
    # 2 layers x (K + V) x 4 tokens x 2 KV heads x 64 dims = 2,048 elements per block.
    assert blocks["auto"] == blocks["float32"] == budget // (2048 * 4)
    assert blocks["bfloat16"] == budget // (2048 * 2) == 2 * blocks["float32"]
    # int8: 64 one-byte codes and a 4-byte scale per token and KV head.
    assert blocks["int8"] == budget // (2 * 2 * 4 * 2 * 68)
    engine = make_engine("bfloat16")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in engine.model_runner.kv_caches)
    engine = make_engine("int8")
    assert all(k.dtype == v.dtype == torch.int8 and k.shape == (128, 4, 2, 68) for k, v in engine.model_runner.kv_caches)
    assert engine.bytes_per_block == 2 * 2 * 4 * 2 * 68


@pytest.mark.parametrize("head_dim", [64, 16])  # the AVX-512 kernel and the generic one
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_decode_equals_recomputing_the_whole_sequence(head_dim, kv_cache_dtype):
    """Each decode step reads the rounded K/V of earlier steps; recomputing the sequence from
    scratch (prefill of prompt + tokens so far, one token at a time) rounds the same values."""
    prompt = [random.Random(0).randrange(TINY_VOCAB) for _ in range(23)]
    decoded = generate(make_engine(kv_cache_dtype, head_dim), [prompt], 20)
    tokens, logprobs = [], []
    for _ in range(20):
        [(token, logprob)] = generate(make_engine(kv_cache_dtype, head_dim), [prompt + tokens], 1)
        tokens += token
        logprobs += logprob
    assert_same(decoded, [(tokens, logprobs)])
    unrounded = generate(make_engine("float32", head_dim), [prompt], 20)
    assert max(abs(a - b) for a, b in zip(unrounded[0][1], logprobs)) > 1e-2  # the test can tell


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_chunked_prefill_prefix_cache_and_preemption_read_the_same_values(kv_cache_dtype):
    rng = random.Random(1)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(24)]
    prompts = [shared + [rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (3, 17, 30, 9)]
    expected = [generate(make_engine(kv_cache_dtype, enable_prefix_caching=False), [p], 24)[0] for p in prompts]
    chunked = generate(make_engine(kv_cache_dtype, max_num_batched_tokens=16, enable_prefix_caching=False),
                       prompts, 24)
    assert_same(chunked, expected)
    engine = make_engine(kv_cache_dtype)  # prefix caching on: later prompts hit the shared blocks
    assert_same([generate(engine, [p], 24)[0] for p in prompts], expected)
    assert engine.kv_cache_manager.prefix_cache_hits > 0
    tight = make_engine(kv_cache_dtype, num_gpu_blocks_override=30, max_model_len=120)
    assert_same(generate(tight, prompts, 24), expected)
    assert tight.scheduler.num_preemptions > 0


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'bfloat16', 'float32', 'int8'\], "
                                         r"got 'fp8' \(fp8 KV caches are not supported on the CPU\)"):
        EngineArgs.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"got 'bf16'$"):
        EngineArgs.from_kwargs(kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' needs dtype float32, got bfloat16: use"):
        EngineArgs.from_kwargs(kv_cache_dtype="float32").kv_cache_torch_dtype(torch.bfloat16)
    assert EngineArgs.from_kwargs().kv_cache_torch_dtype(torch.bfloat16) == torch.bfloat16
