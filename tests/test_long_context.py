"""Long documents on a small dummy model (``load_format="dummy"``, 1 layer of one 64-wide head,
so a 32k prompt costs seconds): a second question about the same 16k document computes only
what the prefix cache cannot serve, and a 32k prompt prefilled in chunks grows the process by
its KV cache and a per-chunk scratch linear in the context, never a chunk's full
``[q_len, context_len]`` score matrix. See docs/benchmarks/serving-size.md."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers.ops import native_ops
from pagedllm.platform import process_rss_bytes
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
CHUNK = 2048


def _engine(tmp_path, max_model_len: int, num_blocks: int, dtype: str) -> LLMEngine:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
              "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 40960, "tie_word_embeddings": False, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return LLMEngine(EngineArgs(model=str(tmp_path), load_format="dummy", dtype=dtype, block_size=BLOCK_SIZE,
                                num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
                                max_num_batched_tokens=CHUNK, max_num_seqs=4))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _answer(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int, int]:
    """Greedy 4 tokens alone in the engine: (tokens, prompt tokens computed, num_cached_tokens)."""
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    computed, final = 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output if output.finished else final
        computed += engine.make_stats().iteration.num_prompt_tokens
    return list(final.outputs[0].token_ids), computed, final.num_cached_tokens


# bfloat16 takes the AVX512_BF16 prefill kernel where the CPU has it, float32 the exact one.
DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_second_question_about_a_16k_document_computes_only_the_question(tmp_path, dtype):
    document = _ids(16384 + 7, seed=1)  # 1,024 full blocks, and 7 tokens of a block the question ends
    first, second = _ids(40, seed=2), _ids(56, seed=3)
    engine = _engine(tmp_path, max_model_len=16500, num_blocks=2 * 16500 // BLOCK_SIZE, dtype=dtype)

    _, computed, cached = _answer(engine, "q1", document + first)
    assert (computed, cached) == (len(document) + len(first), 0)

    hits_before = engine.get_kv_cache_stats().prefix_cache_hits
    tokens, computed, cached = _answer(engine, "q2", document + second)
    assert cached == 16384 and engine.get_kv_cache_stats().prefix_cache_hits - hits_before == 16384
    assert computed == 7 + len(second)

    engine.reset_prefix_cache()
    recomputed_tokens, computed, cached = _answer(engine, "q2-again", document + second)
    assert (computed, cached) == (len(document) + len(second), 0)
    assert tokens == recomputed_tokens
    engine.kv_cache_manager.block_pool.check_invariants()
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_of_a_32k_prompt_grows_memory_linearly(tmp_path, dtype):
    """The exact prefill kernel's scratch per call is the context's K transposed to fp32
    (``num_kv_heads * head_dim * context_len`` floats: 8 MiB here) plus a 16-query tile of scores
    per thread (the AVX2 build's: up to 8 MiB of scores per thread), the bf16 kernel's its K and V
    packed in bf16 (8 MiB); a chunk's ``[2048, 32768]`` fp32 score matrix would be 256 MiB, a
    whole prompt's 4 GiB. (With 128 rows of scores per thread the AVX2 build grew 132 MiB here in
    a whole-suite run on an AVX2-only view of the CPU, ``AVX2_CPU_ENV``; 60 MiB alone since.)"""
    if native_ops() is None:
        pytest.skip("the C++ ops are not loaded: the SDPA fallback builds a [q_len, context_len] mask per "
                    "chunk (bench/long_context.py measures it)")
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # probes that the peak (VmHWM) can be reset here
    except OSError as error:
        pytest.skip(f"cannot reset the peak resident size: {error}")
    num_tokens = 32768
    engine = _engine(tmp_path, max_model_len=num_tokens + 8, num_blocks=(num_tokens + 8) // BLOCK_SIZE + 1,
                     dtype=dtype)
    kv_pool_bytes = engine.num_blocks * engine.bytes_per_block
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    before = process_rss_bytes()
    _, computed, _ = _answer(engine, "long", _ids(num_tokens, seed=4))
    growth = _peak_rss() - before
    assert computed == num_tokens
    assert growth < kv_pool_bytes + 96 * 2**20, f"peak grew {growth / 2**20:.0f} MiB, KV pool {kv_pool_bytes / 2**20:.0f} MiB"
