"""Case B18, exactly: neither the batch nor preemption by recompute changes a seeded sample, not
even the last bit of a logprob.

A preempted request's KV is recomputed by a prefill of its prompt and the tokens it had generated,
which first ran as decode steps. The prefill attention kernel gives each row bitwise what the
decode kernel gives (``csrc/prefill_attention.cpp``); where every other layer is row-wise exact
too (unquantized bf16 through ``bf16_linear``, fp32 through ``fp32_linear``, and ``w8a8`` /
``w4a8`` in either dtype: integer products with per-token scales), the recomputed KV and every
later logit are bitwise those of the run without preemption, so seeded sampling draws the same
tokens. The weight-only int8 / int4 kernels (a kernel for decode-size batches,
dequantize-and-GEMM for a prefill) are close, not exact; docs/sampling.md says so. On CPUs with AMX that holds with ``PAGEDLLM_BATCH_INVARIANT=1``
(the default there multiplies bf16 weights with oneDNN's AMX kernels, whose rows depend on the
row count). With AVX512_BF16 it holds by default too: bf16 prompt rows run a kernel of bf16 dot
products, which is not the decode kernel's, so a recompute gives the rows of output tokens the
exact kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers import ops
from pagedllm.layers.linear import amx_preferred
from pagedllm.models.loader import build_model
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

# (compute dtype, quantization, kv_cache_dtype): the row-wise exact configurations.
EXACT_CONFIGS = [("bfloat16", None, "auto"), ("bfloat16", None, "int8"),
                 ("float32", None, "auto"), ("float32", None, "int8"), ("float32", None, "bfloat16"),
                 ("bfloat16", "w8a8", "int8"), ("bfloat16", "w8a8", "auto"), ("bfloat16", "w4a8", "int8"),
                 ("float32", "w8a8", "auto"), ("float32", "w8a8", "int8"), ("float32", "w4a8", "bfloat16")]


@pytest.fixture(scope="module")
def kernel():
    native = ops.native_ops()
    if native is None or not native.prefill_attention_supported(64):
        pytest.skip("no exact prefill kernel in this build (AVX2 or AVX-512): prefill attention is torch's SDPA, "
                    "whose rows are close to the decode kernel's, not bitwise equal")
    return native


def _run(model, dtype: str, kv_cache_dtype: str, prompts, params, num_blocks: int):
    model.fused_decode.invalidate()
    engine = LLMEngine(EngineArgs.from_kwargs(
        dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=16, num_gpu_blocks_override=num_blocks,
        max_model_len=160, max_num_seqs=8, max_num_batched_tokens=96), model=model, tokenizer=None)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params[index])
    finals = run_to_completion(engine)
    pool = engine.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0
    return [finals[str(i)].outputs[0] for i in range(len(prompts))], engine.scheduler.num_preemptions


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", EXACT_CONFIGS + [
    # weight-only: exact under PAGEDLLM_BATCH_INVARIANT=1 only (prefill chunks then take the
    # decode kernels rather than dequantize-and-GEMM)
    ("float32", "int8", "auto"), ("float32", "int4", "auto"), ("bfloat16", "int8", "auto"),
    ("bfloat16", "int4", "bfloat16")])
def test_seeded_samples_and_their_logprobs_survive_preemption_bitwise(kernel, dtype, quantization, kv_cache_dtype,
                                                                      architecture, monkeypatch):
    """8 seeded requests (temperature 1) each run alone, then together in a pool that holds
    them all, then together in a pool too small for them: the same tokens and bitwise the same
    logprobs all three ways. A tiny llama with SmolLM2's head_dim of 64, so that the native
    prefill kernel runs, and prompts that span key tiles and blocks (the kernel's order must
    hold across both); 96-token steps mix decode rows with prefill chunks. Qwen2 adds biases to
    the Q/K/V projections. ``PAGEDLLM_BATCH_INVARIANT=1`` keeps bf16 weights in their tiles on
    CPUs with AMX, where oneDNN's AMX matmul would take them (elsewhere the default already)."""
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
    _check_seeded_samples_survive_preemption(dtype, quantization, kv_cache_dtype, architecture)


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_bf16_prompts_on_bf16_dot_products_survive_preemption_bitwise(kernel, quantization, monkeypatch):
    """The default on CPUs with AVX512_BF16 (no ``PAGEDLLM_BATCH_INVARIANT``): bf16 prompt rows
    over a bf16 cache run ``paged_prefill_attention_bf16``, whose rows are not the decode
    kernel's; a recompute after preemption gives the rows of output tokens the exact kernel, as
    their decode steps had, so the samples still survive bitwise (case B18, found by a new user
    on a Zen 4: 1 of 8 greedy SmolLM2 outputs changed after preemption). Without the bf16 kernel
    in the build the exact one runs throughout, and the same holds."""
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
    if amx_preferred():
        pytest.skip("on CPUs with AMX the default multiplies bf16 weights with oneDNN's AMX kernels, "
                    "whose rows depend on the row count: invariance needs PAGEDLLM_BATCH_INVARIANT=1")
    _check_seeded_samples_survive_preemption("bfloat16", quantization, "auto", "llama")


def _check_seeded_samples_survive_preemption(dtype: str, quantization, kv_cache_dtype: str, architecture: str):
    config = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, architecture=architecture,
                         attention_bias=architecture == "qwen2")
    model = build_model(config, tiny_state_dict(config, seed=4), getattr(torch, dtype), quantization,
                        calibration_token_ids=list(range(64)) if quantization == "w8a8" else None)
    rng = random.Random(18)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=60, ignore_eos=True, logprobs=1)
              for i in range(8)]

    def sampled(outputs):
        return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outputs]

    alone = [sampled(_run(model, dtype, kv_cache_dtype, [p], [sp], num_blocks=64)[0])[0]
             for p, sp in zip(prompts, params)]
    together, preemptions = _run(model, dtype, kv_cache_dtype, prompts, params, num_blocks=64)
    assert preemptions == 0
    assert sampled(together) == alone
    # 12 blocks of 16 tokens hold 192 tokens; the 8 requests grow to ~500.
    preempted, preemptions = _run(model, dtype, kv_cache_dtype, prompts, params, num_blocks=12)
    assert preemptions > 0
    assert sampled(preempted) == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm2_greedy_and_seeded_outputs_survive_preemption(kernel, dtype, monkeypatch):
    """Case B18 as new users ran it (2026-12-07, Zen 4): the real SmolLM2, default settings, 8
    prompts that share a prefix, each run alone and then all in a 16-block pool that preempts
    them. In bf16, before output tokens' rows were given the exact kernel on recompute, 1 of 8
    greedy and 4 of 8 seeded outputs changed there; in fp32 (the default dtype on CPUs without
    bf16 units), before fp32 weights went to ``fp32_linear``'s tiles, 3 of 8 seeded ones."""
    from pagedllm import LLM

    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
    if amx_preferred():
        pytest.skip("on CPUs with AMX invariance needs PAGEDLLM_BATCH_INVARIANT=1 (oneDNN's AMX matmul)")
    prefix = "You are a helpful assistant. Please answer the following question in detail and with care. "
    prompts = [prefix + q for q in ["What is the tallest mountain?", "Why is the sky blue?", "Explain gravity.",
                                    "What is a prime number?", "Describe a cat.", "How do airplanes fly?",
                                    "What is Python?", "Name the planets."]]
    roomy = LLM(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=1 << 28, enable_prefix_caching=False)
    small = LLM(dtype=dtype, max_model_len=256, num_gpu_blocks_override=16)
    for params in (SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=1234, max_tokens=64, ignore_eos=True)):
        alone = [roomy.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in prompts]
        before = small.llm_engine.scheduler.num_preemptions
        preempted = [output.outputs[0].token_ids for output in small.generate(prompts, params, use_tqdm=False)]
        assert small.llm_engine.scheduler.num_preemptions > before
        assert preempted == alone
        assert small.llm_engine.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("quantization", [None, "w8a8"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_prompt_token_computed_alone_gives_the_same_samples(kernel, quantization, batch_invariant, monkeypatch):
    """Prompts of 17, 33 and 49 tokens (blocks of 16) prefilled whole, in chunks of 16 (the
    last chunk one token) and after a prefix-cache hit on all their full blocks (one token left
    to compute): the same seeded tokens and bitwise the same logprobs all three ways. Found by
    a new user (2026-12-07, Zen 4, SmolLM2 in bf16 by default): a one-token prompt chunk ran as a
    decode row through the exact decode kernel where the other prompt rows ran the bf16 prefill
    kernel, and a chat prompt's first-token logprob moved by 0.011."""
    if batch_invariant:
        monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
    else:
        monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
        if amx_preferred():
            pytest.skip("on CPUs with AMX invariance needs PAGEDLLM_BATCH_INVARIANT=1 (oneDNN's AMX matmul)")
    config = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64)
    model = build_model(config, tiny_state_dict(config, seed=4), torch.bfloat16, quantization,
                        calibration_token_ids=list(range(64)) if quantization == "w8a8" else None)
    rng = random.Random(33)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(length)] for length in (17, 33, 49)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)

    def run_alone(budget: int, prefix_caching: bool, repeats: int):
        model.fused_decode.invalidate()
        engine = LLMEngine(EngineArgs.from_kwargs(
            dtype="bfloat16", block_size=16, num_gpu_blocks_override=16, max_model_len=64, max_num_seqs=4,
            max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching), model=model, tokenizer=None)
        results = []
        for index, prompt in enumerate(prompts):
            for repeat in range(repeats):
                hits = engine.kv_cache_manager.prefix_cache_hits
                engine.add_request(f"{index}-{repeat}", prompt, params)
                output = run_to_completion(engine)[f"{index}-{repeat}"].outputs[0]
                if repeat:
                    assert engine.kv_cache_manager.prefix_cache_hits - hits == len(prompt) - 1
            results.append((output.token_ids, [lp[t].logprob for lp, t in zip(output.logprobs, output.token_ids)]))
        assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
        return results

    whole = run_alone(64, False, 1)
    assert run_alone(16, False, 1) == whole
    assert run_alone(64, True, 2) == whole
