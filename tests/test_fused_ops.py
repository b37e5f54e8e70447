"""The fused C++ ops (pagedllm/csrc/fused_ops.cpp) against their torch formulations, and the
whole-layer decode op (decoder_layer.cpp) against the Python layers.

fp32 results must agree to summation-order rounding (rtol 1e-6); bf16 ones to one bf16
rounding. Inputs are strided views where the model passes views (rows of the fused QKV and
gate/up projections).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import ops
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.models.llama import RotaryEmbedding
from pagedllm.models.loader import build_model
from pagedllm.worker.model_runner import ModelRunner
from tests.conftest import tiny_config, tiny_state_dict

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


@pytest.fixture(scope="module")
def native():
    native = ops.native_ops()
    if native is None:
        pytest.fail("the C++ ops did not build (see the warning logged by native_ops)")
    return native


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_rms_norm(native, dtype, rows):
    x = randn(rows, 96, dtype=dtype) * 3
    weight = 1 + randn(96, dtype=dtype, seed=1) * 0.1
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), ops.rms_norm_torch(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_residual_in_place(native, dtype):
    x, residual = randn(33, 96, dtype=dtype), randn(33, 96, dtype=dtype, seed=1)
    weight = 1 + randn(96, dtype=dtype, seed=2) * 0.1
    expected_residual = residual + x
    expected = ops.rms_norm_torch(expected_residual, weight, 1e-6)
    out = native.add_rms_norm_(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_rotates_q_and_k_only(native, dtype):
    num_q, num_kv, head_dim, tokens = 6, 2, 64, 19
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = randn(tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(3))
    expected = qkv.clone()
    ops.rotary_embedding_torch_(expected, positions, rotary.cos, rotary.sin, num_q, num_kv, head_dim)
    out = qkv.clone()
    native.rotary_embedding_(out, positions, rotary.cos, rotary.sin, num_q, num_kv, head_dim)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    v = slice((num_q + num_kv) * head_dim, None)
    assert torch.equal(out[:, v], qkv[:, v])


def test_rotary_embedding_matches_hf_formula():
    """The torch reference is HF's ``apply_rotary_pos_emb`` on [tokens, heads, head_dim]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    num_q, num_kv, head_dim, tokens = 4, 2, 32, 9
    rotary = RotaryEmbedding(head_dim, 64, 500000.0)
    qkv = randn(tokens, (num_q + 2 * num_kv) * head_dim)
    positions = torch.arange(20, 20 + tokens)
    q = qkv[:, :num_q * head_dim].view(1, tokens, num_q, head_dim).transpose(1, 2)
    k = qkv[:, num_q * head_dim:(num_q + num_kv) * head_dim].view(1, tokens, num_kv, head_dim).transpose(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, rotary.cos[positions][None], rotary.sin[positions][None])
    out = qkv.clone()
    ops.rotary_embedding_(out, positions, rotary.cos, rotary.sin, num_q, num_kv, head_dim)
    torch.testing.assert_close(out[:, :num_q * head_dim], q_hf.transpose(1, 2).reshape(tokens, -1), **TOL[torch.float32])
    torch.testing.assert_close(out[:, num_q * head_dim:(num_q + num_kv) * head_dim],
                               k_hf.transpose(1, 2).reshape(tokens, -1), **TOL[torch.float32])


def test_rotary_embedding_rejects_positions_outside_the_table(native):
    rotary = RotaryEmbedding(32, 16, 10000.0)
    qkv = randn(2, 4 * 32)
    with pytest.raises(ValueError, match=r"positions\[1\] = 16 is outside \[0, 16\)"):
        native.rotary_embedding_(qkv, torch.tensor([3, 16]), rotary.cos, rotary.sin, 2, 1, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(native, dtype):
    x = randn(21, 2 * 80, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_and_mul(x), F.silu(gate) * up, **TOL[dtype])


def test_reshape_and_cache_writes_strided_rows_into_their_slots(native):
    num_blocks, block_size, num_kv, head_dim = 6, 4, 2, 8
    key_cache = torch.zeros(num_blocks, block_size, num_kv, head_dim)
    value_cache = torch.zeros_like(key_cache)
    qkv = randn(5, 3 * num_kv * head_dim)  # keys and values are views with a row stride
    key, value = qkv[:, num_kv * head_dim:2 * num_kv * head_dim], qkv[:, 2 * num_kv * head_dim:]
    slots = torch.tensor([0, 5, 23, 9, 14])
    native.reshape_and_cache_(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache.view(-1, num_kv * head_dim)[slots], key, rtol=0, atol=0)
    torch.testing.assert_close(value_cache.view(-1, num_kv * head_dim)[slots], value, rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not key_cache.view(-1, num_kv * head_dim)[untouched].any()
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 24 is outside \[0, 24\)"):
        native.reshape_and_cache_(key[:1], value[:1], key_cache, value_cache, torch.tensor([24]))


def test_reshape_and_cache_rounds_fp32_rows_into_a_bf16_cache(native):
    """Rounded to nearest even, bitwise as torch's .to(bfloat16), natively and in the fallback."""
    num_kv, head_dim = 2, 8
    key, value = randn(5, num_kv * head_dim, seed=2), randn(5, num_kv * head_dim, seed=3)
    slots = torch.tensor([3, 0, 17, 8, 22])

    def write(reshape_and_cache_):
        caches = [torch.zeros(6, 4, num_kv, head_dim, dtype=torch.bfloat16) for _ in range(2)]
        reshape_and_cache_(key, value, *caches, slots)
        return [cache.view(-1, num_kv * head_dim)[slots] for cache in caches]

    for cached, rows in zip(write(ops.reshape_and_cache_.forward_cpu), (key, value)):
        assert torch.equal(cached, rows.to(torch.bfloat16))
    for cached, rows in zip(write(ops.reshape_and_cache_.forward_native), (key, value)):
        assert torch.equal(cached, rows.to(torch.bfloat16))
    with pytest.raises(ValueError, match="the same, int8, or bfloat16 caches for float32 key/value"):
        native.reshape_and_cache_(key.bfloat16(), value.bfloat16(), torch.zeros(6, 4, num_kv, head_dim),
                                  torch.zeros(6, 4, num_kv, head_dim), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_quantizes_rows_into_an_int8_cache(native, dtype):
    """kv_cache_dtype="int8": per token and KV head, codes round(x / scale) with scale =
    max |x| / 127 in the row's last 4 bytes; natively bitwise what the torch fallback writes.
    Each value comes back within half a step; a zero row comes back as zeros, a row holding
    NaN or infinity as NaN."""
    num_kv, head_dim = 3, 16
    key, value = randn(6, num_kv * head_dim, seed=4).to(dtype), randn(6, num_kv * head_dim, seed=5).to(dtype)
    key[1, :head_dim] = 0
    key[2, head_dim] = float("nan")
    value[3, 2 * head_dim + 1] = float("inf")
    key[4, 5] = 1e-30  # a row whose values are all but one tiny
    # Scale exactly 1: every code is a tie, rounded half to even (the AVX-512 path and the scalar one).
    key[5, head_dim:2 * head_dim] = torch.tensor([127.0] + [k + 0.5 for k in range(-7, 8)])
    slots = torch.tensor([3, 0, 17, 8, 22, 11])

    def write(reshape_and_cache_):
        caches = [torch.zeros(6, 4, num_kv, head_dim + 4, dtype=torch.int8) for _ in range(2)]
        reshape_and_cache_(key, value, *caches, slots)
        return caches

    native_caches = write(ops.reshape_and_cache_.forward_cpu)
    torch_caches = write(ops.reshape_and_cache_.forward_native)
    for native_cache, torch_cache, rows in zip(native_caches, torch_caches, (key, value)):
        assert torch.equal(native_cache, torch_cache)
        cached = native_cache.view(-1, num_kv, head_dim + 4)[slots]
        values = ops.dequantize_kv(cached, torch.float32)
        rows = rows.float().view(6, num_kv, head_dim)
        scale = cached[..., head_dim:].contiguous().view(torch.float32)
        finite = torch.isfinite(rows).all(-1)
        torch.testing.assert_close(scale[finite], rows.abs().amax(-1, keepdim=True)[finite] / 127, rtol=0, atol=0)
        assert ((values - rows).abs() <= scale / 2 * (1 + 1e-6))[finite].all()
        assert values[~finite].isnan().all() and (~finite).sum() == 1
    assert not ops.dequantize_kv(native_caches[0].view(-1, num_kv, head_dim + 4)[0, 0], torch.float32).any()


def test_ops_fall_back_to_torch_without_the_extension(monkeypatch):
    """With the extension turned off every op computes the same values in torch."""
    x, weight = randn(5, 64), 1 + randn(64, seed=1) * 0.1
    expected = ops.rms_norm(x, weight, 1e-5)
    assert ops.rms_norm._forward_method is ops.native_ops().rms_norm
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    ops.native_ops.cache_clear()
    try:
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected, **TOL[torch.float32])
        assert ops.rms_norm._forward_method == ops.rms_norm.forward_native
        gate_up = randn(3, 16)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :8]) * gate_up[:, 8:])
    finally:
        monkeypatch.delenv("PAGEDLLM_NATIVE_OPS")
        ops.native_ops.cache_clear()


DECODE_OP_CONFIGURATIONS = [
    (torch.float32, None, torch.float32), (torch.float32, "int8", torch.float32),
    (torch.float32, "int4", torch.float32), (torch.float32, "int4", torch.bfloat16),
    (torch.bfloat16, None, torch.bfloat16), (torch.bfloat16, "int8", torch.bfloat16),
    (torch.bfloat16, "int4", torch.bfloat16), (torch.float32, "w8a8", torch.float32),
    (torch.bfloat16, "w8a8", torch.bfloat16), (torch.float32, "w4a8", torch.float32),
    (torch.bfloat16, "w4a8", torch.bfloat16), (torch.float32, None, torch.int8),
    (torch.bfloat16, "w8a8", torch.int8)]


@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", DECODE_OP_CONFIGURATIONS)
@pytest.mark.parametrize("attention_bias", [False, True])  # with a bias, w8a8's qkv has 4 tensors
def test_decode_layer_op_equals_python_layers(dtype, quantization, kv_cache_dtype, attention_bias):
    """A decode step through the C++ ``decode_layers`` op (one call for all layers) gives bitwise the
    hidden states and KV writes of the Python layers: same ops, same order."""
    config = tiny_config(attention_bias=attention_bias)
    model = build_model(config, tiny_state_dict(config), dtype, quantization=quantization)
    assert_decode_op_equals_python_layers(model, kv_cache_dtype)


_FAMILIES = {"qwen3": {}, "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                            norm_topk_prob=True, mlp_only_layers=[0]),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", DECODE_OP_CONFIGURATIONS)
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_decode_layer_op_equals_python_layers_with_qk_norms_and_experts(tmp_path, family, dtype, quantization,
                                                                      kv_cache_dtype):
    """The op's two variations of the layer, bitwise the Python layers too: Qwen3's per-head q/k
    norms, and a MoE block (router, top-k, experts; Qwen3-MoE with a dense first layer, and
    Mixtral's always renormalized top-k)."""
    from transformers import AutoConfig

    from pagedllm.models.dummy import load_dummy_checkpoint

    AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                         **_FAMILIES[family]).to_json_file(tmp_path / "config.json")
    config, weights = load_dummy_checkpoint(str(tmp_path / "config.json"), dtype)
    # Weights wider than the dummy's 0.02, so that routing and norms see varied values.
    state_dict = {name: weights[name] * (1 if name.endswith("norm.weight") else 50) for name in weights}
    model = build_model(config, state_dict, dtype, quantization=quantization, calibration_token_ids=[1, 2, 3])
    assert model.fused_decode is not None
    assert_decode_op_equals_python_layers(model, kv_cache_dtype)


def assert_decode_op_equals_python_layers(model, kv_cache_dtype) -> None:
    assert ops.native_ops() is not None
    head_dim = model.config.head_dim
    runner = ModelRunner(model, num_blocks=16, block_size=4, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    # Three sequences with 5, 9 and 2 tokens cached (random K/V), each decoding one token.
    for cache in runner.kv_caches:
        for tensor in cache:
            if tensor.dtype == torch.int8:
                tensor.copy_(ops.quantize_kv(torch.randn(*tensor.shape[:-1], head_dim, generator=g)))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=g))
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]])
    context_lens = torch.tensor([6, 10, 3])
    positions = context_lens - 1
    slots = tables.gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    metadata = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3, decode_block_tables=tables,
                                 decode_context_lens=context_lens)
    ids = torch.tensor([7, 100, 255])

    def run(fused):
        model.fused_decode.enabled = fused
        model.fused_decode.invalidate()
        hidden = model(ids, positions, runner.kv_caches, metadata)
        return hidden, [t.clone() for cache in runner.kv_caches for t in cache]

    python_hidden, python_caches = run(False)
    native_hidden, native_caches = run(True)
    assert model.fused_decode.layer_args is not None  # the C++ path ran
    assert torch.equal(native_hidden, python_hidden)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, python_caches))


@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # 7: no full 16-lane chunk
def test_argmax_logsumexp_matches_torch(native, vocab):
    logits = randn(6, vocab) * 4
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # tie: first index wins
    logits[2] = float("-inf")                                          # every token masked
    logits[3, vocab // 2] = float("nan")
    logits[4, :vocab - 1] = float("-inf")                              # only the last one left
    logits[5, 0] = float("inf")
    argmax, lse = native.argmax_logsumexp(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, logits.logsumexp(dim=-1), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("family,width", [("llama", dict(intermediate_size=48)),
                                          ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=48))])
def test_int8_widths_the_kernels_do_not_take_decode_through_the_python_layers(tmp_path, family, width):
    """int8 quantizes a projection of any width, and its Python ``forward`` multiplies an
    ``in_features`` outside groups of 32 by the dequantized weight; the C++ kernel refuses one.
    The fused decode op declines such a model (it raised on every decode step, so each request
    ended after its first token with an error)."""
    from transformers import AutoConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.fused_decode import kernels_take

    AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, max_position_embeddings=256,
                         **width).to_json_file(tmp_path / "config.json")
    llm = LLM(model=str(tmp_path / "config.json"), load_format="dummy", quantization="int8", dtype="float32",
              max_model_len=64, num_gpu_blocks_override=16, block_size=4)
    model = llm.llm_engine.model
    assert model.fused_decode is not None and not kernels_take(model.layers)
    output, = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 6
