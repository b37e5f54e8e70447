"""``Linear``: the plain ``torch.mm`` layout and the oneDNN-packed one compute the same values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.linear import Linear, packing_available
from pagedllm.layers.quantization import weight_bytes


def make_linear(dtype: torch.dtype, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(96, 160, bias=bias)
    linear.set_weight(torch.randn(160, 96, generator=g), dtype)
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(160, generator=g).to(dtype), requires_grad=False)
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_plain_mm(dtype, bias, rows):
    """bf16: bitwise (oneDNN computes both); fp32: to summation order (MKL vs oneDNN)."""
    if not packing_available():
        pytest.skip("torch has no oneDNN here")
    linear = make_linear(dtype, bias)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected, weight, size = linear(x), linear.weight.clone(), weight_bytes(linear)
    assert linear.pack() and linear.weight_t is None and linear.packed.is_mkldnn
    assert torch.equal(linear.weight, weight) and weight_bytes(linear) == size
    if dtype == torch.bfloat16:
        assert torch.equal(linear(x), expected)
    else:
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", "0")
    linear = make_linear(torch.float32, bias=False)
    assert not linear.pack() and linear.packed is None and linear.weight_t is not None
