"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) against Hugging Face transformers fp32,
and the fused experts path (tokens grouped by expert, one GEMM pair per active expert) against
the per-token loop it replaces, float and quantized (int8, int4, w8a8, w4a8), fp32 and bf16.

Tolerances: greedy tokens equal and prompt logprobs within ``LOGPROB_TOL`` (1e-4,
tests/test_model_families.py); fused against per-token: ``FUSED_TOL`` (the same products, each
expert's rows multiplied together or one row at a time, so only the GEMM kernels' summation order
differs: measured up to 1.9e-5 in fp32 on outputs of a few units).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.fused_moe import experts_per_token, fused_experts, route
from pagedllm.models.loader import build_model, load_checkpoint
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.sharding import TensorParallelShard
from tests.test_model_families import assert_parity, random_prompts, save_tiny_hf

FUSED_TOL = 1e-4
FAMILIES = {
    # A dense first layer (mlp_only_layers) and renormalized top-k, as the released checkpoints.
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[0], head_dim=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=3, clip_qkv=2.0, intermediate_size=32),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf(request.param, folder, **FAMILIES[request.param])
    config, state_dict = load_checkpoint(folder)
    return request.param, hf, config, state_dict


def test_moe_equals_transformers(tiny_moe):
    name, hf, config, state_dict = tiny_moe
    model = build_model(config, state_dict, torch.float32)
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(blocks) == (1 if name == "qwen3_moe" else 2) and (model.fused_decode is None) == (name == "olmoe")
    assert blocks[0].normalize == (name != "olmoe")
    assert_parity(hf, model, random_prompts(30, 4))


def assert_fused_equals_per_token(block: SparseMoeBlock, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
    """fp32 within ``FUSED_TOL``; bf16 within torch's bf16 tolerance (measured: bitwise equal)."""
    x = torch.randn(37, hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, expert_ids = route(block.gate(x), block.top_k, block.normalize)
    assert len(set(expert_ids.flatten().tolist())) > 1
    tolerance = dict(rtol=0, atol=FUSED_TOL) if dtype == torch.float32 else {}
    torch.testing.assert_close(fused_experts(x, block.experts, weights, expert_ids),
                               experts_per_token(x, block.experts, weights, expert_ids), **tolerance)


def test_fused_experts_equal_the_per_token_loop(tiny_moe):
    """The same block's experts, grouped by expert or token by token."""
    _, _, config, state_dict = tiny_moe
    model = build_model(config, state_dict, torch.float32)
    assert_fused_equals_per_token(next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)),
                                  config.hidden_size)


@pytest.mark.parametrize("quantization,layer", [("int8", "Int8Linear"), ("int4", "Int4Linear"),
                                                ("w8a8", "W8A8Linear"), ("w4a8", "W4A8Linear")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts(tmp_path, quantization, layer, dtype):
    """Each method quantizes every expert's projections (the router stays float); the fused
    path and the per-token loop run the same quantized layers."""
    save_tiny_hf("mixtral", tmp_path, **FAMILIES["mixtral"])
    config, state_dict = load_checkpoint(tmp_path)
    model = build_model(config, state_dict, dtype, quantization)
    block = model.layers[0].mlp
    assert {type(m).__name__ for e in block.experts for m in (e.gate_up_proj, e.down_proj)} == {layer}
    assert type(block.gate).__name__ == "Linear"
    assert_fused_equals_per_token(block, config.hidden_size, dtype)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_native_equal_their_torch_twins(tmp_path, monkeypatch, quantization, dtype):
    """The same quantized experts with the C++ kernels and with ``PAGEDLLM_NATIVE_OPS=0`` (their
    torch twins): fp32 within 1e-4 on outputs of up to ~60 (measured 3.1e-5), bf16 within
    torch's bf16 tolerance and 2^-5 (measured 0.016)."""
    from pagedllm.layers import ops

    save_tiny_hf("mixtral", tmp_path, **FAMILIES["mixtral"])
    config, state_dict = load_checkpoint(tmp_path)
    block = build_model(config, state_dict, dtype, quantization).layers[0].mlp
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, expert_ids = route(block.gate(x), block.top_k, block.normalize)
    native = fused_experts(x, block.experts, weights, expert_ids)
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    ops.native_ops.cache_clear()
    try:
        reference = fused_experts(x, block.experts, weights, expert_ids)
    finally:
        monkeypatch.delenv("PAGEDLLM_NATIVE_OPS")
        ops.native_ops.cache_clear()
    tolerance = dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2 ** -5)
    torch.testing.assert_close(native, reference, **tolerance)


def test_route_normalizes_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.equal(weights, probs[:, :2])
    weights, _ = route(logits, 2, normalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum(), rtol=0, atol=0)


def test_moe_refusals(tiny_moe):
    _, _, config, state_dict = tiny_moe
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only, got 2"):
        build_model(config, state_dict, torch.float32, tp=TensorParallelShard(0, 2))
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the .* family runs with tensor_parallel_size=1"):
        TensorParallelShard(0, 2).check(config)
    with pytest.raises(ValueError, match="quantization='awq' is not supported for mixture-of-experts"):
        build_model(config, state_dict, torch.float32, "awq")


def test_unknown_architectures_are_refused_by_name(tmp_path):
    """A folder or GGUF of an architecture without a model class: a ``ValueError`` naming it
    and listing what is supported (the MoE families among them)."""
    import json

    import gguf

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v3' is not supported \(supported: .*'qwen3_moe', "
                                         r"'mixtral', 'olmoe'\)"):
        load_checkpoint(tmp_path)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "deepseek2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from pagedllm.models.loader import _read_gguf

    with pytest.raises(ValueError, match=r"GGUF architecture 'deepseek2' is not supported \(supported: .*'phi3'"):
        _read_gguf(tmp_path / "m.gguf")
