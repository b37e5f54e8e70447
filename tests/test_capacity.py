"""``python -m pagedllm.planner.capacity``: KV bytes per token from a config.json equal the
engine's own for the model built from it, and the replayed long-document workload against a
contiguous ``max_model_len`` reservation. See docs/benchmarks/serving-size.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.config import EngineArgs, kv_cache_bytes_per_block
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.dummy import load_dummy_checkpoint
from pagedllm.planner.capacity import (ANSWER_TOKENS, MIN_DOCUMENT_TOKENS, capacity_row, facts_from_config,
                                       long_document_trace, main)

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "configs"


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_bytes_per_token_are_the_engines(kv_cache_dtype):
    path = CONFIGS / "tiny-llama.json"
    engine = LLMEngine(EngineArgs(model=str(path), load_format="dummy", dtype="bfloat16",
                                  kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=8, max_model_len=64))
    assert facts_from_config(path, kv_cache_dtype).bytes_per_block(16) == engine.bytes_per_block


@pytest.mark.parametrize("name", ["Llama-3.1-8B-Instruct", "Llama-3.2-3B-Instruct", "SmolLM2-1.7B-Instruct"])
def test_bytes_per_token_of_the_bench_configs_follow_the_loaded_config(name):
    config, _ = load_dummy_checkpoint(str(CONFIGS / f"{name}.json"), torch.bfloat16)
    expected = kv_cache_bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                        16, torch.bfloat16)
    assert facts_from_config(CONFIGS / f"{name}.json", "bfloat16").bytes_per_block(16) == expected


def test_long_documents_fit_paged_at_least_as_contiguous(capsys):
    facts = facts_from_config(CONFIGS / "tiny-llama.json", "bfloat16")
    budget = 3 * 8192 * facts.bytes_per_block(16) // 16 + 100
    row = capacity_row(facts, budget, max_model_len=8192, num_requests=8)
    assert row.contiguous_requests == 3
    assert row.paged_peak_requests >= row.contiguous_requests
    # Admission reserves each document's whole prompt: no preemption, nothing computed twice.
    assert (row.num_preemptions, row.recompute_factor) == (0, 1.0)
    trace = long_document_trace(8, 8192, facts.vocab_size)
    assert all(MIN_DOCUMENT_TOKENS <= r.num_prompt_tokens <= 8192 - ANSWER_TOKENS for r in trace)
    assert len({r.prompt_token_ids[0] for r in trace}) == 8
    assert main([str(CONFIGS / "tiny-llama.json"), "--kv-cache-bytes", str(budget), "--max-model-len", "8192",
                 "--kv-cache-dtype", "bfloat16", "--num-requests", "8"]) == 0
    assert f"| tiny-llama | bfloat16 | 512 | 8,192 | 3 | {row.paged_peak_requests} / " in capsys.readouterr().out


def test_bad_budgets_and_configs_are_clear_errors(tmp_path, capsys):
    """A fresh user's reports: 99999999TiB spun building its pool, 1KiB named an internal
    option and exited 0 with an empty table, a config without a field was a KeyError."""
    tiny = str(CONFIGS / "tiny-llama.json")
    for budget, message in (("99999999TiB", "a replay holds at most"), ("1KiB", "the budget holds no KV block of")):
        assert main([tiny, "--kv-cache-bytes", budget, "--max-model-len", "8192", "--kv-cache-dtype", "int8"]) == 1
        out, err = capsys.readouterr()
        assert message in out and "error: no configuration fits" in err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    for path, message in ((empty, "the config has no 'num_attention_heads'"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(path)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
