"""The scripts of issue 38 run: ``bench/peers/dummy_gguf.py`` writes a GGUF that pagedllm's own GGUF
reader takes back with the config's architecture and the real weight shapes, and
``bench/scale.py`` runs end to end on the tiny config (its smoke run; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.models.dummy import hf_weight_shapes
from pagedllm.models.hf_config import config_from_hf
from pagedllm.models.loader import _read_gguf
from pagedllm.models.moe import SparseMoeBlock

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

import dummy_gguf  # noqa: E402
import scale  # noqa: E402


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_dummy_gguf_has_the_configs_shapes(tmp_path, tensor_type):
    raw = json.loads((BENCH / "configs" / "tiny-llama.json").read_text())
    raw["vocab_size"] = 512  # room for the placeholder vocabulary's 259 special and byte tokens
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(raw))
    dummy_gguf.write_dummy_gguf(config_path, tmp_path / "model.gguf", tensor_type)
    read_config, state_dict, _ = _read_gguf(tmp_path / "model.gguf")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rope_theta"):
        assert read_config[key] == raw[key], key
    expected = hf_weight_shapes(config_from_hf(raw, has_lm_head=True))
    assert {name: tuple(t.shape) for name, t in state_dict.items()} == expected


TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 300,
                  "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "rope_theta": 1e6,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": []}


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_dummy_gguf_writes_qwen3_moe(tmp_path, monkeypatch, tensor_type):
    """A qwen3_moe config (head_dim 32, not hidden / heads = 16) is written as llama.cpp's
    ``qwen3moe``: the reader gets its shapes and MoE fields back, experts stacked and quantized,
    the router F32, and the engine builds and runs the model."""
    import gguf

    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(TINY_QWEN3_MOE))
    dummy_gguf.write_dummy_gguf(config_path, tmp_path / "model.gguf", tensor_type)
    types = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
             for t in gguf.GGUFReader(str(tmp_path / "model.gguf")).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == (tensor_type, (8, 64, 32))
    assert types["blk.1.ffn_gate_inp.weight"] == ("F32", (8, 64))
    assert types["blk.1.attn_q_norm.weight"] == ("F32", (32,))
    read_config, state_dict, _ = _read_gguf(tmp_path / "model.gguf")
    assert read_config["model_type"] == "qwen3_moe"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rope_theta",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"):
        assert read_config[key] == TINY_QWEN3_MOE[key], key
    expected = hf_weight_shapes(config_from_hf(TINY_QWEN3_MOE, has_lm_head=True))
    assert {name: tuple(t.shape) for name, t in state_dict.items()} == expected
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=str(tmp_path / "model.gguf"), dtype="float32", kv_cache_memory_bytes=16 * 2**20,
              max_model_len=256)
    assert isinstance(llm.llm_engine.model.layers[1].mlp, SparseMoeBlock)
    output, = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_dummy_gguf_refuses_other_families(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**TINY_QWEN3_MOE, "model_type": "gemma3_text"}))
    with pytest.raises(ValueError, match="gemma3_text"):
        dummy_gguf.write_dummy_gguf(config_path, tmp_path / "x.gguf")
    config_path.write_text(json.dumps({**TINY_QWEN3_MOE, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match="experts in every layer"):
        dummy_gguf.write_dummy_gguf(config_path, tmp_path / "x.gguf")


def test_scale_benchmark_smoke_run_on_the_tiny_config(tmp_path):
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args(["--config", str(BENCH / "configs" / "tiny-llama.json"), "--contexts", "256", "50000",
                              "--decode-tokens", "4", "--num-requests", "3", "--prompt-len", "32",
                              "--output-len", "5", "--cached-document", "200", "--question-len", "9",
                              "--json", str(tmp_path / "out.json")])
    results = scale.run(args)
    # The second question finds the document's 12 full blocks of 16 (192 of its 200 tokens).
    assert results["cached_document"]["second_hit_tokens"] == 192
    assert [row["context"] for row in results["single_stream"]] == [256]  # 50000 is over the model's 40960
    assert results["throughput"]["num_requests"] == 3
    assert json.loads((tmp_path / "out.json").read_text())["single_stream"][0]["context"] == 256


def test_roofline_pairs_each_decode_step_with_a_read_of_its_bytes():
    """``bench/roofline.py``'s paired decode on the tiny config: one fraction per decode step,
    every one a real ratio of rates, the read covering each storage of the step's weights and the
    KV pool once, and the request's blocks back in the pool afterwards."""
    import roofline

    parser = argparse.ArgumentParser()
    scale.add_model_arguments(parser)
    args = parser.parse_args(["--config", str(BENCH / "configs" / "tiny-llama.json"), "--dtype", "float32"])
    llm = scale.build_llm(args, 64 + 8, -(-(64 + 8) // scale.BLOCK_SIZE) + 1)
    engine = llm.llm_engine
    weights = roofline.step_weight_tensors(engine.model)
    caches = [cache for layer in engine.model_runner.kv_caches for cache in layer]
    views = roofline.storage_views(weights + caches + caches[:1])  # a storage named twice is read once
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights + caches}
    assert len(views) == len(storages)
    assert sum(view.nbytes for view in views) == sum(nbytes // 4 * 4 for nbytes in storages.values())
    step_bytes = roofline.decode_weight_bytes(engine.model) + 64 * engine.bytes_per_block // scale.BLOCK_SIZE
    paired = roofline.paired_decode(llm, scale._prompt(64, engine.model_config.vocab_size, 1), 5, step_bytes)
    assert len(paired["fractions"]) == 5
    assert all(0 < fraction < float("inf") for fraction in paired["fractions"])
    assert min(paired["fractions"]) <= paired["median"] <= max(paired["fractions"])
    assert not engine.has_unfinished_requests()
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
