"""Every configuration a user can pick: compute dtype x quantization x KV cache dtype x native ops.

Each combination runs the same greedy workload (chunked prefill, batched decode, prompt
logprobs) through the C++ ops and through their torch twins. The two compute the same
arithmetic in a different summation order, and in bfloat16 also with other intermediate
roundings, so they are compared as a user would notice a difference:

- prompt logprobs (teacher-forced, every prompt position) agree within ``tolerance()``;
- greedy outputs agree token for token until a step where the two runs' top two logprobs are
  within ``tolerance()`` of each other (a near-tie, which either path may break either way), and
  the sampled tokens' logprobs agree within ``tolerance()`` up to there.

The tiny random llama gives breadth (every combination); the real SmolLM2 gives a few prompts
per combination, against transformers where fp32 makes it exact (unquantized and int4, whose
codes are the GGUF file's own weights) and against the fp32 model's teacher-forced logprobs
elsewhere. Issue 19.1 was an int4 + bf16 model that no test ran.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers import ops
from pagedllm.models.loader import build_model
from pagedllm.models.quantize import calibration_token_ids
from pagedllm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATIONS = [None, "int8", "int4", "w8a8", "w4a8"]
KV_CACHE_DTYPES = ["auto", "bfloat16", "int8"]
# |logprob difference| allowed between the C++ and the torch path: (largest, mean over the
# prompt). fp32 with an fp32 KV cache: summation order only (measured: tiny model <= 2e-5,
# SmolLM2 <= 4.1e-4 and mean 1.8e-4). With bf16 compute or a bf16 KV cache the paths also
# round intermediates (or K/V near a rounding boundary) differently, each rounding 2^-9
# relative, and the tiny model's logprobs reach -23 (measured on it: largest 0.155, mean
# <= 0.044; SmolLM2 fp32 with a bf16 cache: sampled logprobs up to 3.7e-3 apart). bf16 linear
# layers differ too: the C++ op ``bf16_linear`` sums the same exact products in another order
# than oneDNN's matmul, so a few of its bf16 outputs round to the neighbouring value (SmolLM2
# bf16: largest 0.175, mean 0.067 over five positions) - still a fraction of the 0.25 mean the
# bf16 model may differ from the fp32 one by (test_smollm2_every_configuration).
EXACT_TOL, ROUNDED_TOL = (2e-3, 5e-4), (0.5, 0.15)
# W8A8 rounds every activation to int8 per token (steps of absmax / 127, ~0.8 %): a last-bit
# difference upstream moves a value across a rounding boundary now and then, and the tiny
# model's logprobs reach -23 (measured on it, bf16: largest 0.27, mean <= 0.15). Native prefill
# attention (fp32 tiles) and the torch path's bf16 SDPA differ in the last bits
# of every bf16 attention output: SmolLM2 bf16 w8a8, largest 0.67 at one of five positions,
# mean 0.19. W4A8 rounds activations per 32-input group, the same way.
W8A8_TOL = (1.0, 0.25)
ACTIVATION_QUANTIZATIONS = ("w8a8", "w4a8")


def tolerance(dtype: torch.dtype, kv_cache_dtype: str, quantization: str | None = None) -> tuple[float, float]:
    """W8A8 and W4A8 round every activation to int8: a last-bit difference upstream can move
    a value across a rounding boundary, so they are compared as a rounded path in fp32 too."""
    if quantization in ACTIVATION_QUANTIZATIONS:
        return W8A8_TOL
    return EXACT_TOL if dtype == torch.float32 and kv_cache_dtype == "auto" else ROUNDED_TOL


MAX_TOKENS = 12  # SmolLM2's greedy tokens per prompt
CONFIGS = list(itertools.product(DTYPES, QUANTIZATIONS, KV_CACHE_DTYPES))


@pytest.fixture
def native_off(monkeypatch):
    """Runs the body with the torch twins of every C++ op (``PAGEDLLM_NATIVE_OPS=0``)."""
    def switch(enabled: bool) -> None:
        monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "1" if enabled else "0")
        ops.native_ops.cache_clear()
    yield switch
    monkeypatch.delenv("PAGEDLLM_NATIVE_OPS")
    ops.native_ops.cache_clear()


def greedy_run(engine: LLMEngine, prompts: list, max_tokens: int) -> list:
    """Greedy outputs with the top-2 logprobs of every sampled position and prompt logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                            prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    return [finals[f"p{i}"] for i in range(len(prompts))]


def prompt_logprobs(output) -> list[float]:
    return [next(iter(d.values())).logprob for d in output.prompt_logprobs[1:]]


def top2(entry: dict) -> list[float]:
    return sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]


def assert_same_up_to_near_ties(a, b, tolerance: tuple[float, float]) -> int:
    """The comparison described in the module docstring; returns how many tokens agreed."""
    tol, mean_tol = tolerance
    diffs = [abs(x - y) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    if diffs:
        print(f"prompt logprob differences: largest {max(diffs):.3g}, mean {sum(diffs) / len(diffs):.3g}")
        assert max(diffs) <= tol and sum(diffs) / len(diffs) <= mean_tol, f"prompt logprobs differ: {diffs}"
    tokens_a, tokens_b = a.outputs[0].token_ids, b.outputs[0].token_ids
    for step, (x, y) in enumerate(zip(tokens_a, tokens_b)):
        la, lb = a.outputs[0].logprobs[step], b.outputs[0].logprobs[step]
        if x != y:
            gaps = [first - second for first, second in (top2(la), top2(lb))]
            assert min(gaps) <= tol, f"step {step}: tokens {x} vs {y} with top-2 gaps {gaps}, no near-tie"
            return step
        assert abs(la[x].logprob - lb[y].logprob) <= tol, f"step {step}: logprob of token {x} differs"
    return len(tokens_a)


# ------------------------------------------------------------------------------------ tiny model
@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", CONFIGS)
def test_tiny_model_native_equals_torch(dtype, quantization, kv_cache_dtype, native_off):
    if ops.native_ops() is None:
        pytest.fail("the C++ ops did not build (see the warning logged by native_ops)")
    torch_dtype = DTYPES[dtype]
    config = tiny_config()
    model = build_model(config, tiny_state_dict(config, seed=1), torch_dtype, quantization)
    rng = random.Random(5)
    # 1, 9 and 70 tokens: a prompt inside one block, one across blocks, one in two prefill
    # chunks (the 70-row chunk takes the dequantize path of quantized layers, the rest the kernels).
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (1, 9, 70)]

    def run():
        engine = LLMEngine(EngineArgs.from_kwargs(
            dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=4, num_gpu_blocks_override=96,
            max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48), model=model, tokenizer=None)
        model.fused_decode.invalidate()
        return greedy_run(engine, prompts, max_tokens=12)

    native = run()
    native_off(False)
    reference = run()
    agreed = [assert_same_up_to_near_ties(a, b, tolerance(torch_dtype, kv_cache_dtype, quantization))
              for a, b in zip(native, reference)]
    if tolerance(torch_dtype, kv_cache_dtype, quantization) == EXACT_TOL:
        assert agreed == [12, 12, 12]


# ------------------------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smollm2_weights():
    """The real model's config, fp32 state dict, GGUF 4-bit weights, tokenizer and prompts."""
    from pagedllm.models.loader import load_checkpoint, load_prequantized_int4, load_tokenizer, resolve_model_path
    path = resolve_model_path(None)
    config, state_dict = load_checkpoint(path)
    tokenizer = load_tokenizer(path)
    texts = ["The capital of France is", "def fibonacci(n):",
             "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps"]
    return config, state_dict, load_prequantized_int4(path), tokenizer, [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_weights):
    """Greedy tokens of transformers' fp32 model on the prompts, and the fp32 pagedllm
    model's prompt logprobs (the yardstick for configurations that cannot be exact)."""
    from transformers import LlamaForCausalLM

    from pagedllm.models.loader import model_folder, resolve_model_path
    from tests.test_parity import hf_greedy
    config, state_dict, _, tokenizer, prompts = smollm2_weights
    hf = LlamaForCausalLM.from_pretrained(str(model_folder(resolve_model_path(None))), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts]
    del hf
    engine = smollm2_engine(build_model(config, state_dict, torch.float32), "float32", "auto", tokenizer)
    return expected, [prompt_logprobs(o) for o in greedy_run(engine, prompts, max_tokens=1)]


def smollm2_engine(model, dtype: str, kv_cache_dtype: str, tokenizer) -> LLMEngine:
    model.fused_decode.invalidate()
    return LLMEngine(EngineArgs.from_kwargs(dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                                            kv_cache_memory_bytes=32 * 2**20, max_num_seqs=4,
                                            max_num_batched_tokens=256), model=model, tokenizer=tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,quantization", list(itertools.product(DTYPES, QUANTIZATIONS)))
def test_smollm2_every_configuration(dtype, quantization, smollm2_weights, smollm2_reference, native_off):
    """Both KV cache dtypes, native ops on and off. fp32 unquantized and fp32 int4 with the
    default cache equal transformers token for token; every configuration's teacher-forced
    prompt logprobs stay within 0.25 of the fp32 model's on average over every prompt position
    (measured: bf16 ~0.06, int8 ~0.15), w8a8 / w4a8 within 0.5 (every activation is rounded to
    int8, and over an int8 cache the query too; measured: bf16 w8a8 0.17-0.23 on an AMX Xeon).
    The mean is pooled over the prompts' ~25 positions: the 4 of "def fibonacci(n):" alone
    reached 0.52 in bf16 w8a8 with the int8 cache on that Xeon (0.45 on a Zen 4), where one
    token moves a 4-position mean by ~0.2. Their perplexity over 2,048 tokens is in
    test_quantization.py and docs/models-and-quantization.md. Native equals torch up to
    near-ties."""
    config, state_dict, prequantized, tokenizer, prompts = smollm2_weights
    expected, reference_logprobs = smollm2_reference
    torch_dtype = DTYPES[dtype]
    calibration = calibration_token_ids(tokenizer, config.vocab_size) if quantization == "w8a8" else None
    model = build_model(config, state_dict, torch_dtype, quantization,
                        prequantized if quantization in ("int4", "w4a8") else None,
                        calibration_token_ids=calibration)
    for kv_cache_dtype in KV_CACHE_DTYPES:
        runs = {}
        # The torch twins of the quantized kernels dequantize every weight at every step: two
        # prompts keep that run short.
        for native, native_prompts in ((True, prompts), (False, prompts[:2])):
            native_off(native)
            engine = smollm2_engine(model, dtype, kv_cache_dtype, tokenizer)
            runs[native] = greedy_run(engine, native_prompts, MAX_TOKENS)
            if torch_dtype == torch.float32 and quantization in (None, "int4") and kv_cache_dtype == "auto":
                assert [o.outputs[0].token_ids for o in runs[native]] == expected[:len(native_prompts)], native
            diffs = [abs(x - y) for output, reference in zip(runs[native], reference_logprobs)
                     for x, y in zip(prompt_logprobs(output), reference)]
            mean = sum(diffs) / len(diffs)
            assert mean <= (0.5 if quantization in ACTIVATION_QUANTIZATIONS else 0.25), (native, kv_cache_dtype, mean)
        for a, b in zip(runs[True], runs[False]):
            assert_same_up_to_near_ties(a, b, tolerance(torch_dtype, kv_cache_dtype, quantization))
