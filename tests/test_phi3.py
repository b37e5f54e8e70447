"""Phi-3 (fused qkv_proj / gate_up_proj checkpoints, longrope, partial rotary, sliding window)
against Hugging Face transformers fp32, from a Hugging Face folder and from a GGUF written as
llama.cpp's converter writes one (convert_hf_to_gguf.py ``Phi3MiniModel``).

Tolerances: greedy tokens equal; prompt logprobs within ``LOGPROB_TOL`` (1e-4, fp32 against
fp32 summed in other orders; tests/test_model_families.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.models.loader import build_model, load_checkpoint
from tests.gguf_writer import GGUF_GLOBAL_NAMES, hf_metadata, write_gguf_file
from tests.test_model_families import (LOGPROB_TOL, assert_parity, hf_reference, load_gguf,  # noqa: F401
                                       native, pagedllm_run, random_prompts, save_tiny_hf)

ORIGINAL = 64  # original_max_position_embeddings: prompts of 100 tokens are "long"


def longrope(rotary_dim: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + 0.5 * torch.rand(rotary_dim // 2, generator=g)).tolist(),
            "long_factor": (1 + 19 * torch.rand(rotary_dim // 2, generator=g)).tolist()}


# Phi-4-mini's shape (partial rotary 0.75, tied head: Python layers, torch RoPE) and
# Phi-3.5-mini's (whole-head RoPE, untied head: the fused C++ decode op), both with longrope.
VARIANTS = {
    "phi4mini": dict(rope_parameters={**longrope(12, 0), "partial_rotary_factor": 0.75},
                     original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True, embed_std=0.3),
    "phi35mini": dict(rope_parameters=longrope(16, 1), original_max_position_embeddings=ORIGINAL,
                      tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_phi3(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf("phi3", folder, **VARIANTS[request.param])
    config, state_dict = load_checkpoint(folder)
    return request.param, folder, hf, config, state_dict


def test_phi3_config(tiny_phi3):
    name, _, hf, config, state_dict = tiny_phi3
    assert "model.layers.0.self_attn.qkv_proj.weight" in state_dict
    scaling = config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL
    # factor = 1024 / 64 (max_position_embeddings / original): HF's default attention factor.
    assert scaling["attention_factor"] == math.sqrt(1 + math.log(1024 / ORIGINAL) / math.log(ORIGINAL))
    assert config.rotary_dim == (12 if name == "phi4mini" else None) and config.sliding_window is None
    model = build_model(config, state_dict, torch.float32)
    assert (model.fused_decode is None) == (name == "phi4mini")


def test_phi3_window_and_old_rope_names_are_read():
    """A window as Mistral's (Phi-3-mini-4k: 2047 of 4096); one no shorter than the context is
    none (Phi-3.5-mini: 262144 of 131072); ``su`` is longrope's old name; partial rotary must
    give an even number of features."""
    from pagedllm.models.hf_config import config_from_hf
    from tests.test_model_families import TINY

    raw = {**TINY, "model_type": "phi3", "sliding_window": 511, "original_max_position_embeddings": 64,
           "rope_scaling": {**longrope(16, 2), "type": "su"}}
    raw["rope_scaling"].pop("rope_type")
    config = config_from_hf(raw, True)
    assert config.sliding_window == 511 and config.rope_scaling["rope_type"] == "longrope"
    assert config_from_hf({**raw, "sliding_window": 1024}, True).sliding_window is None
    with pytest.raises(ValueError, match="partial_rotary_factor=0.3125"):
        config_from_hf({**raw, "partial_rotary_factor": 0.3125}, True)
    with pytest.raises(ValueError, match="short_factor has 8 factors, a rotary dimension of 8 needs 4"):
        config_from_hf({**raw, "partial_rotary_factor": 0.5}, True)


@pytest.mark.usefixtures("native")
def test_phi3_long_factors_equal_transformers(tiny_phi3):
    """``max_model_len`` 1024 > 64: long factors, as transformers uses for a 100-token prompt."""
    _, _, hf, config, state_dict = tiny_phi3
    model = build_model(config, state_dict, torch.float32)
    assert_parity(hf, model, random_prompts(100, 70))
    assert model.rotary.long_factors


def test_phi3_short_factors_equal_transformers(tiny_phi3):
    """``max_model_len`` 64: short factors, as transformers uses while a sequence stays within 64."""
    _, _, hf, config, state_dict = tiny_phi3
    model = build_model(config, state_dict, torch.float32)
    prompts = random_prompts(40, 9)
    assert_parity(hf, model, prompts, max_model_len=ORIGINAL)
    assert not model.rotary.long_factors
    # The choice matters: the long factors move these logprobs by far more than the tolerance.
    (_, long_logprobs), = pagedllm_run(model, prompts[:1], max_model_len=1024)
    _, expected = hf_reference(hf, prompts[0])
    assert max(abs(a - b) for a, b in zip(long_logprobs, expected)) > 100 * LOGPROB_TOL


def write_phi3_gguf(path, hf) -> None:
    """``hf`` as llama.cpp's ``Phi3MiniModel`` converter writes it (fp32, no tokenizer)."""
    c = hf.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    scale = c.max_position_embeddings / c.original_max_position_embeddings
    metadata = hf_metadata(
        c, add_rope_scaling_orig_ctx_len=c.original_max_position_embeddings,
        add_rope_dimension_count=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        add_sliding_window=c.sliding_window or 0,
        add_rope_scaling_attn_factors=math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))
    tensors = [("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
               ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))]
    names = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name in GGUF_GLOBAL_NAMES:
            tensors.append((GGUF_GLOBAL_NAMES[name], tensor.float().numpy()))
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        tensors.append((f"blk.{layer}.{names[module]}.{kind}", tensor.float().numpy()))
    write_gguf_file(path, "phi3", metadata, tensors)


def test_phi3_gguf_equals_transformers(tiny_phi3, tmp_path):
    name, _, hf, folder_config, _ = tiny_phi3
    write_phi3_gguf(tmp_path / "m.gguf", hf)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert (config.architecture, config.rotary_dim, config.sliding_window, config.tie_word_embeddings) == (
        "phi3", folder_config.rotary_dim, folder_config.sliding_window, folder_config.tie_word_embeddings)
    # The attention factor llama.cpp states equals HF's default to the last bit or so.
    assert config.rope_scaling["attention_factor"] == pytest.approx(folder_config.rope_scaling["attention_factor"],
                                                                    rel=1e-7)
    assert_parity(hf, build_model(config, state_dict, torch.float32), random_prompts(100))


def test_phi3_gguf_int4_weights_are_split_like_the_float_ones():
    from pagedllm.layers.quantization import Int4Weight
    from pagedllm.models.phi3 import Phi3ForCausalLM

    codes = torch.arange(6 * 32, dtype=torch.uint8).view(6, 32) % 16
    fused = Int4Weight(codes, torch.ones(6, 1), torch.zeros(6, 1))
    raw = {"head_dim": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 3}
    split = Phi3ForCausalLM.gguf_int4_to_hf({"model.layers.0.self_attn.qkv_proj.weight": fused,
                                             "model.layers.0.mlp.gate_up_proj.weight": fused}, raw)
    assert torch.equal(split["model.layers.0.self_attn.k_proj.weight"].codes, codes[2:4])
    assert torch.equal(split["model.layers.0.mlp.up_proj.weight"].codes, codes[3:6])
    with pytest.raises(ValueError, match="expected 7 rows, got 6"):
        Phi3ForCausalLM.gguf_int4_to_hf({"x.self_attn.qkv_proj.weight": fused}, {**raw, "num_attention_heads": 3})
