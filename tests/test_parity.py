"""Greedy output of the real SmolLM2 equals Hugging Face transformers token for token (fp32).

The reference is ``transformers.LlamaForCausalLM`` loaded from the same dequantized weights
(the folder the GGUF is converted to), run one prompt at a time with ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.config import EngineArgs
from pagedllm.models.loader import model_folder, resolve_model_path
from tests.conftest import run_to_completion

pytestmark = pytest.mark.slow

MAX_TOKENS = 32

_PARAGRAPH = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
              "as his father had taught him, and lit the great lamp that warned ships away from the "
              "rocks. Fishermen in the village said the light had never once failed in forty years. ")


def parity_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 1 to ~600 tokens."""
    texts = ["Hi", "The capital of France is", "def fibonacci(n):",
             "List three colors of the rainbow:", _PARAGRAPH, _PARAGRAPH * 3, _PARAGRAPH * 8,
             _PARAGRAPH * 12 + "In summary,"]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts[0] = prompts[0][:1]
    assert len(prompts[0]) == 1 and 550 <= len(prompts[-1]) <= 700, [len(p) for p in prompts]
    return prompts


@pytest.fixture(scope="module")
def setup(smollm2_llm_fp32):
    from transformers import LlamaForCausalLM

    engine = smollm2_llm_fp32.llm_engine
    prompts = parity_prompts(engine.tokenizer)
    hf = LlamaForCausalLM.from_pretrained(str(model_folder(resolve_model_path(None))), dtype=torch.float32)
    hf.eval()
    return engine, prompts, [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with EOS ignored, written out over HF's forward and its KV cache
    (``generate``'s ``min_new_tokens`` would mask EOS, which is not what ignore_eos means)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def engine_like(base: LLMEngine, **overrides) -> LLMEngine:
    """A new engine over the same loaded model with other scheduling/pool options."""
    kwargs = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 * 2**20)
    kwargs.update(overrides)
    return LLMEngine(EngineArgs.from_kwargs(**kwargs), model=base.model, tokenizer=base.tokenizer)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    finals = run_to_completion(engine)
    return [finals[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_greedy_equals_transformers_batched(setup):
    engine, prompts, expected = setup
    assert generate(engine, prompts) == expected


def test_greedy_equals_transformers_one_by_one(setup):
    engine, prompts, expected = setup
    for prompt, want in zip(prompts, expected):
        assert generate(engine, [prompt]) == [want]


def test_greedy_equals_transformers_under_preemption(setup):
    base, prompts, expected = setup
    # 48 blocks x 16 = 768 token slots for ~1,450 tokens of prompts and outputs.
    engine = engine_like(base, num_gpu_blocks_override=48, max_model_len=768)
    assert generate(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_greedy_equals_transformers_with_chunked_prefill(setup):
    base, prompts, expected = setup
    engine = engine_like(base, max_num_batched_tokens=64, max_num_seqs=8)
    assert generate(engine, prompts) == expected


def test_llm_generate_text_api(smollm2_llm_fp32, setup):
    _, prompts, expected = setup
    tokenizer = smollm2_llm_fp32.get_tokenizer()
    outputs = smollm2_llm_fp32.generate(["The capital of France is", {"prompt_token_ids": prompts[2]}],
                                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                        use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted(o.request_id for o in outputs)
    assert outputs[0].prompt == "The capital of France is"
    assert outputs[0].outputs[0].token_ids == expected[1]
    assert outputs[0].outputs[0].text == tokenizer.decode(expected[1], skip_special_tokens=True)
    assert outputs[1].prompt is None and outputs[1].outputs[0].token_ids == expected[2]
    assert all(o.finished for o in outputs)


def test_bf16_answers_the_capital_question_as_fp32_does(smollm2_llm_fp32):
    """Found by a fresh-user check: the README's first command, in bf16 (what ``dtype="auto"``
    picks on CPUs with bf16 units), answered "L'Étoile, la Marseillaise, la femme..." to "What is
    the capital of France?". The bf16 LM head rounded the logits of "The" (-1.93) and "L"
    (-1.97) to one bf16 value, and greedy broke the tie by token id. With the head's fp32 sums
    the bf16 model answers as the fp32 one (which equals transformers, above)."""
    from pagedllm import LLM

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    want = smollm2_llm_fp32.chat(messages, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    got = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    top = sorted((lp.logprob for lp in got.logprobs[0].values()), reverse=True)
    assert top[0] > top[1]
