"""Gemma 2 (attention and final logit soft-capping, alternating sliding window,
query_pre_attn_scalar, four norms per layer) against Hugging Face transformers fp32, from a
Hugging Face folder and from a GGUF written as llama.cpp's converter writes one
(convert_hf_to_gguf.py ``Gemma2Model``: norms stored plus one).

Caps of 5 and 10 (Gemma 2 ships 50 and 30) so that both move the result: the test also checks
that the uncapped model does not pass. Tolerances: greedy tokens equal; prompt logprobs within
``LOGPROB_TOL`` (1e-4, tests/test_model_families.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.layers.attention import AttentionMetadata, PrefillSequence, paged_attention
from pagedllm.models.loader import build_model, load_checkpoint
from tests.gguf_writer import GGUF_GLOBAL_NAMES, hf_metadata, write_gguf_file
from tests.test_model_families import (LOGPROB_TOL, assert_parity, hf_reference, load_gguf, pagedllm_run,
                                       random_prompts, save_tiny_hf)

GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=5.0,
              final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma2")
    hf = save_tiny_hf("gemma2", folder, **GEMMA2)
    config, state_dict = load_checkpoint(folder)
    return hf, config, state_dict


def test_gemma2_config(tiny_gemma2):
    _, config, _ = tiny_gemma2
    assert (config.architecture, config.qk_norm, config.layer_types) == (
        "gemma2", False, ("sliding_attention", "full_attention"))
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.query_pre_attn_scalar,
            config.sliding_window, config.tie_word_embeddings) == (5.0, 10.0, 24.0, 16, True)


def test_gemma2_equals_transformers(tiny_gemma2):
    """40-token prompts: the window of 16 cuts the local layer's prefill and decode."""
    hf, config, state_dict = tiny_gemma2
    model = build_model(config, state_dict, torch.float32)
    prompts = random_prompts(40, 5)
    assert_parity(hf, model, prompts)
    # Chunks of 12 tokens: the capped attention over a cached prefix, window included.
    assert_parity(hf, model, prompts[:1], max_num_batched_tokens=12)
    # Without either cap the same weights give other logprobs (the caps are computed, not skipped).
    _, expected = hf_reference(hf, prompts[0])
    for uncapped in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None}):
        other = build_model(dataclasses.replace(config, **uncapped), state_dict, torch.float32)
        (_, logprobs), = pagedllm_run(other, prompts[:1])
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) > 100 * LOGPROB_TOL


def test_softcapped_decode_equals_softcapped_prefill():
    """A capped decode row (torch decode path) equals the last row of the capped prefill of
    the same sequence (torch prefill path), window included, up to fp32 summation order (the
    two paths reduce in another order: 1.4e-6 apart at a value of 3.4 on an AMX Xeon)."""
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim, n = 4, 8, 4, 2, 16, 11
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    q, k, v = (torch.randn(n, h, head_dim) * 3 for h in (heads, kv_heads, kv_heads))
    table = torch.tensor([3, 1, 5])
    slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    prefill = paged_attention(q, k, v, key_cache, value_cache,
                              AttentionMetadata(slots, prefills=[PrefillSequence(0, n, n, table)]), 0.25, 5, 2.0)
    decode = paged_attention(q[-1:], k[-1:], v[-1:], key_cache, value_cache,
                             AttentionMetadata(slots[-1:], 1, table[None], torch.tensor([n])), 0.25, 5, 2.0)
    torch.testing.assert_close(decode, prefill[-1:], rtol=2e-6, atol=1e-6)
    uncapped = paged_attention(q[-1:], k[-1:], v[-1:], key_cache, value_cache,
                               AttentionMetadata(slots[-1:], 1, table[None], torch.tensor([n])), 0.25, 5)
    assert (uncapped - decode).abs().max() > 1e-2


def write_gemma2_gguf(path, hf) -> None:
    """``hf`` as llama.cpp's ``Gemma2Model`` converter writes it (fp32, no tokenizer)."""
    c = hf.config
    metadata = hf_metadata(c, add_key_length=c.head_dim, add_value_length=c.head_dim,
                           add_attn_logit_softcapping=c.attn_logit_softcapping,
                           add_final_logit_softcapping=c.final_logit_softcapping, add_sliding_window=c.sliding_window)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    tensors = []
    for name, tensor in hf.state_dict().items():
        array = tensor.float().numpy() + (1 if name.endswith("norm.weight") else 0)
        if name == "lm_head.weight":
            continue
        if name in GGUF_GLOBAL_NAMES:
            tensors.append((GGUF_GLOBAL_NAMES[name], array))
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            tensors.append((f"blk.{layer}.{names[module]}.{kind}", array))
    write_gguf_file(path, "gemma2", metadata, tensors)


def test_gemma2_gguf_equals_transformers(tmp_path):
    """query_pre_attn_scalar is not in the file: llama.cpp takes head_dim (16 here)."""
    hf = save_tiny_hf("gemma2", tmp_path, **{**GEMMA2, "query_pre_attn_scalar": 16})
    write_gemma2_gguf(tmp_path / "m.gguf", hf)
    config, state_dict = load_gguf(tmp_path / "m.gguf")
    assert (config.architecture, config.attn_logit_softcapping, config.final_logit_softcapping,
            config.query_pre_attn_scalar, config.layer_types) == (
        "gemma2", 5.0, 10.0, 16.0, ("sliding_attention", "full_attention"))
    assert_parity(hf, build_model(config, state_dict, torch.float32), random_prompts(40))
