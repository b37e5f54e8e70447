"""The scripts of issue 38 run: ``bench/peers/dummy_gguf.py`` writes a GGUF that pagedllm's own GGUF
reader takes back with the config's architecture and the real weight shapes, and
``bench/scale.py`` runs end to end on the tiny config (its smoke run; see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from pagedllm.models.dummy import hf_weight_shapes
from pagedllm.models.hf_config import config_from_hf
from pagedllm.models.loader import _read_gguf

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


def test_dummy_gguf_refuses_other_families(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe"):
        dummy_gguf.write_dummy_gguf(BENCH / "configs" / "Qwen3-30B-A3B.json", tmp_path / "x.gguf")


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
