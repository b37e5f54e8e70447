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
def test_packed_linear_equals_plain_mm(dtype, bias, rows, monkeypatch):
    """bf16: bitwise (oneDNN computes both); fp32: to summation order (MKL vs oneDNN).
    Packing is forced on, so that fp32 is tested on Intel CPUs too."""
    monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", "1")
    if not torch.backends.mkldnn.is_available():
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
    linear = make_linear(torch.bfloat16, bias=False)
    assert not linear.pack() and linear.packed is None and linear.weight_t is not None


@pytest.mark.parametrize("vendor,dtype,packs", [("GenuineIntel", torch.float32, False),
                                                ("GenuineIntel", torch.bfloat16, True),
                                                ("AuthenticAMD", torch.float32, True)])
def test_packing_is_chosen_by_cpu_vendor_and_dtype(vendor, dtype, packs, monkeypatch):
    """fp32 stays on MKL's torch.mm on Intel CPUs; elsewhere, and for bf16, weights are packed."""
    from pagedllm.layers import linear as linear_module
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch has no oneDNN here")
    monkeypatch.delenv("PAGEDLLM_PACK_WEIGHTS", raising=False)
    monkeypatch.setattr(linear_module, "_cpu_vendor", lambda: vendor)
    assert packing_available(dtype) is packs
    assert make_linear(dtype, bias=False).pack() is packs
