"""``Linear``: the plain ``torch.mm`` layout, the oneDNN-packed one and the bf16 and fp32 tiles
of ``bf16_linear`` and ``fp32_linear`` compute the same values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.huge_pages import move_weights_to_huge_pages
from pagedllm.layers.linear import (Linear, bf16_linear, block_bf16, block_fp32, fp32_linear, packing_available,
                                    unblock_bf16, unblock_fp32)
from pagedllm.layers.ops import native_ops
from pagedllm.layers.quantization import weight_bytes

needs_native = pytest.mark.skipif(native_ops() is None, reason="the C++ ops are not built here")


@pytest.fixture(autouse=True)
def batch_invariant(monkeypatch):
    """bf16 weights go to the tiles this file tests, also on CPUs with AMX (where oneDNN would
    take them by default: test_bf16_weights_take_onednn_on_amx_unless_batch_invariant)."""
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")


def make_linear(dtype: torch.dtype, bias: bool, seed: int = 0, in_features: int = 96,
                out_features: int = 160) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(in_features, out_features, bias=bias)
    linear.set_weight(torch.randn(out_features, in_features, generator=g), dtype)
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(out_features, generator=g).to(dtype), requires_grad=False)
    return linear


def reference(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """fp64 product of the layer's (exactly representable) weights."""
    y = x.double() @ linear.weight.double().t()
    return y + linear.bias.double() if linear.bias is not None else y


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_plain_mm(bias, rows, monkeypatch):
    """fp32 oneDNN-packed against MKL's plain ``torch.mm``: equal to summation order. Packing is
    forced on, so that it is tested on Intel CPUs too; 150 output features are no whole number
    of the fp32 tiles' 32, which would take the layer otherwise."""
    monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", "1")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch has no oneDNN here")
    linear = make_linear(torch.float32, bias, out_features=150)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    expected, weight, size = linear(x), linear.weight.clone(), weight_bytes(linear)
    assert linear.pack() and linear.weight_t is None and linear.packed.is_mkldnn
    assert torch.equal(linear.weight, weight) and weight_bytes(linear) == size
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 64, 121, 300])
@pytest.mark.parametrize("shape", [(96, 160), (1536, 64), (30, 32)])
def test_bf16_tiles_equal_the_reference(bias, rows, shape):
    """A bf16 layer packs into ``bf16_linear``'s tiles (weights kept exactly); its products are
    the fp64 ones rounded to bf16, within fp32 summation error, on the AVX512_BF16 path and the
    portable FMA one alike, at every row count of the register tiles (1-12, 13 = 12 + 1) and
    across the 120-row blocks (121, 300)."""
    in_features, out_features = shape
    linear = make_linear(torch.bfloat16, bias, in_features=in_features, out_features=out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    plain, weight, size = linear(x), linear.weight.clone(), weight_bytes(linear)
    assert linear.pack() and linear.weight_t is None and linear.packed is None
    assert linear.blocked.shape == (out_features // 32, in_features // 2, 32, 2)
    assert torch.equal(linear.weight, weight) and weight_bytes(linear) == size
    expected = reference(x, linear)
    bound = 2.0 ** -8 * expected.abs() + 1e-5 * (x.double().abs() @ weight.double().abs().t())
    for portable in (False, True):
        y = native_ops().bf16_linear(x, linear.blocked, linear.bias, portable)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        assert ((y.double() - expected).abs() <= bound).all()
    assert torch.equal(linear(x), native_ops().bf16_linear(x, linear.blocked, linear.bias))
    torch.testing.assert_close(linear(x), plain)  # oneDNN's / MKL's bf16 product, to rounding


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 160), (1536, 64), (30, 32)])
def test_fp32_tiles_rows_do_not_depend_on_the_batch(bias, shape):
    """An fp32 layer packs into ``fp32_linear``'s tiles (weights kept exactly); every row's
    result is bitwise the same alone, in batches of every register-tile size (1-13) and across
    the 120-row blocks (121, 300), with 1 thread or all: what makes fp32 seeded sampling the
    same batched and after preemption (case B18). Within fp32 summation error of fp64."""
    in_features, out_features = shape
    linear = make_linear(torch.float32, bias, in_features=in_features, out_features=out_features)
    weight, size = linear.weight.clone(), weight_bytes(linear)
    assert linear.pack() and linear.weight_t is None and linear.packed is None
    assert linear.blocked.shape == (out_features // 32, in_features, 32)
    assert torch.equal(linear.weight, weight) and weight_bytes(linear) == size
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([linear(x[r:r + 1]) for r in range(len(x))])
    for rows in [1, 2, 5, 12, 13, 121, 300]:
        assert torch.equal(linear(x[:rows]), alone[:rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)
    expected = reference(x, linear)
    bound = 1e-5 * (x.double().abs() @ weight.double().abs().t()) + 1e-6
    assert ((alone.double() - expected).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("rows", [1, 4, 13])
def test_fp32_linear_sums_the_products_in_input_order_with_one_fma_each(rows):
    """``fp32_linear``'s documented order, emulated: a product of two fp32 values is exact in
    fp64, so ``acc + x * w`` in fp64 rounded to fp32 is one FMA (but where the fp64 sum itself
    rounds onto an fp32 tie, too rare to meet with these seeds); inputs in order from 0, then
    the bias. The same bits on every ISA build (this test runs under each); the reversed order
    rounds elsewhere."""
    g = torch.Generator().manual_seed(rows)
    k, n = 200, 64
    x, w, bias = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    acc = torch.zeros(rows, n, dtype=torch.float32)
    for i in range(k):
        acc = (acc.double() + x[:, i:i + 1].double() * w[:, i].double()).float()
    expected = acc + bias
    assert torch.equal(native_ops().fp32_linear(x, block_fp32(w), bias), expected)
    assert not torch.equal(native_ops().fp32_linear(x.flip(1).contiguous(), block_fp32(w.flip(1)), bias), expected)


def test_block_fp32_layout():
    """``blocked[t, i, c] = weight[32 t + c, i]``, and ``unblock_fp32`` inverts it; the torch
    twin of the op (native ops off) multiplies by the unblocked weight."""
    weight = torch.arange(64 * 5, dtype=torch.float32).view(64, 5)
    blocked = block_fp32(weight)
    assert blocked.shape == (2, 5, 32) and blocked[1, 3, 7] == weight[32 + 7, 3]
    assert torch.equal(unblock_fp32(blocked), weight)
    x = torch.randn(3, 5)
    torch.testing.assert_close(fp32_linear.forward_native(x, blocked, None), x @ weight.t())


def test_block_bf16_layout():
    """``blocked[t, p, c, i] = weight[32 t + c, 2 p + i]``, and ``unblock_bf16`` inverts it."""
    weight = torch.arange(64 * 6, dtype=torch.float32).view(64, 6).bfloat16()
    blocked = block_bf16(weight)
    assert blocked.shape == (2, 3, 32, 2)
    assert blocked[1, 2, 5, 1] == weight[32 + 5, 2 * 2 + 1]
    assert torch.equal(unblock_bf16(blocked), weight)


@needs_native
@pytest.mark.parametrize("shape", [(96, 100), (95, 160)])
def test_bf16_layers_the_tiles_cannot_take_stay_plain_or_onednn(shape):
    """Odd ``in_features`` or ``out_features`` not a multiple of 32: no tiles."""
    in_features, out_features = shape
    linear = make_linear(torch.bfloat16, bias=False, in_features=in_features, out_features=out_features)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = linear(x)
    linear.pack()
    assert linear.blocked is None
    torch.testing.assert_close(linear(x), expected)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 13, 121])
def test_bf16_linear_fp32_out_is_the_unrounded_sum(bias, rows):
    """``fp32_out`` (what the LM head asks for: ``Linear(x, out_dtype=torch.float32)``) hands
    over the fp32 sums that the bf16 output rounds: the same sums, within fp32 summation error
    of the fp64 product, and not on bf16's grid (a bf16 head's logits became exact ties). The
    torch path (native ops off) gives the fp32 product of the same bf16 values."""
    linear = make_linear(torch.bfloat16, bias, in_features=160, out_features=96)
    assert linear.pack() and linear.blocked is not None
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = reference(x, linear)
    bound = 1e-5 * (x.double().abs() @ linear.weight.double().abs().t()) + 1e-6
    for portable in (False, True):
        rounded = native_ops().bf16_linear(x, linear.blocked, linear.bias, portable)
        full = native_ops().bf16_linear(x, linear.blocked, linear.bias, portable, True)
        assert full.dtype == torch.float32 and full.shape == rounded.shape
        assert torch.equal(full.bfloat16(), rounded)
        assert ((full.double() - expected).abs() <= bound).all()
        assert (full.bfloat16().float() != full).float().mean() > 0.9
    assert torch.equal(linear(x, out_dtype=torch.float32), native_ops().bf16_linear(x, linear.blocked, linear.bias,
                                                                                     False, True))
    torch_path = bf16_linear.forward_native(x, linear.blocked, linear.bias, fp32_out=True)
    assert torch_path.dtype == torch.float32 and ((torch_path.double() - expected).abs() <= bound).all()


@needs_native
def test_bf16_linear_rejects_bad_shapes():
    blocked = block_bf16(torch.zeros(32, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[rows, 8\]"):
        native_ops().bf16_linear(torch.zeros(2, 6, dtype=torch.bfloat16), blocked, None)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        native_ops().bf16_linear(torch.zeros(2, 8), blocked, None)
    with pytest.raises(ValueError, match=r"bias must be bfloat16 \[32\]"):
        native_ops().bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), blocked, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[N / 32, K / 2, 32, 2\]"):
        native_ops().bf16_linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(32, 8, dtype=torch.bfloat16), None)


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", "0")
    linear = make_linear(torch.bfloat16, bias=False)
    assert not linear.pack() and linear.packed is None and linear.blocked is None and linear.weight_t is not None


@pytest.mark.parametrize("vendor,dtype,packs", [("GenuineIntel", torch.float32, False),
                                                ("GenuineIntel", torch.bfloat16, True),
                                                ("AuthenticAMD", torch.float32, True)])
def test_packing_is_chosen_by_cpu_vendor_and_dtype(vendor, dtype, packs, monkeypatch):
    """Without the C++ ops' tiles, fp32 stays on MKL's torch.mm on Intel CPUs; elsewhere, and
    for bf16, weights are packed for oneDNN. With them, both dtypes take the tiles."""
    from pagedllm.layers import linear as linear_module
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch has no oneDNN here")
    if dtype == torch.bfloat16 and not linear_module._onednn_bf16_supported():
        pytest.skip("oneDNN runs no bf16 on this CPU (test_bf16_is_never_packed_where_onednn_cannot_run_it)")
    monkeypatch.delenv("PAGEDLLM_PACK_WEIGHTS", raising=False)
    monkeypatch.setattr(linear_module, "cpu_vendor", lambda: vendor)
    assert packing_available(dtype) is packs
    linear = make_linear(dtype, bias=False)
    assert linear.pack() is (packs or native_ops() is not None)
    assert (linear.blocked is not None) is (native_ops() is not None)


@needs_native
@pytest.mark.parametrize("amx,invariant,tiles", [(False, False, True), (True, True, True), (True, False, False)])
def test_bf16_weights_take_onednn_on_amx_unless_batch_invariant(amx, invariant, tiles, monkeypatch):
    """On CPUs with AMX-BF16 oneDNN's packed matmul (AMX tiles, 8-10x faster at prefill) takes
    bf16 weights; ``PAGEDLLM_BATCH_INVARIANT=1`` keeps them in the tiles, whose rows do not
    depend on the batch. Patched so that every CPU with oneDNN bf16 runs each branch."""
    from pagedllm.layers import linear as linear_module
    if not linear_module._onednn_bf16_supported():
        pytest.skip("oneDNN runs no bf16 on this CPU (test_bf16_is_never_packed_where_onednn_cannot_run_it)")
    monkeypatch.delenv("PAGEDLLM_PACK_WEIGHTS", raising=False)
    monkeypatch.setattr(linear_module, "_has_amx_bf16", lambda: amx)
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1" if invariant else "0")
    assert linear_module.amx_preferred() is (amx and not invariant)
    linear = make_linear(torch.bfloat16, bias=True, in_features=160, out_features=96)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(3)).bfloat16()
    expected = reference(x, linear)
    assert linear.pack()
    assert (linear.blocked is not None, linear.packed is not None) == (tiles, not tiles)
    bound = 1e-5 * (x.double().abs() @ linear.weight.double().abs().t()) + 1e-6
    # Each output is the fp32 sum rounded once to bf16: within half a bf16 step of it.
    assert ((linear(x).double() - expected).abs() <= expected.abs() * 2.0 ** -8 + bound).all()


@needs_native
def test_the_lm_head_keeps_the_tiles_on_amx(monkeypatch):
    """With oneDNN taking the decoder's bf16 layers (AMX), the LM head stays in the tiles: its
    logits are the unrounded fp32 sums (a bf16-rounded head made exact ties in greedy picks)."""
    from pagedllm.layers import linear as linear_module
    from pagedllm.models.loader import build_model
    from tests.conftest import tiny_config, tiny_state_dict
    if not linear_module._onednn_bf16_supported():
        pytest.skip("oneDNN runs no bf16 on this CPU")
    monkeypatch.setattr(linear_module, "_has_amx_bf16", lambda: True)
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "0")
    config = tiny_config(hidden_size=128, intermediate_size=256, head_dim=32)
    model = build_model(config, tiny_state_dict(config), torch.bfloat16)
    assert model.lm_head.blocked is not None
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert projections and all(m.packed is not None and m.blocked is None for m in projections)
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and (logits.bfloat16().float() != logits).float().mean() > 0.9


@pytest.mark.parametrize("shape", [(161, 96), (160, 100)])
def test_bf16_is_never_packed_where_onednn_cannot_run_it(shape, monkeypatch):
    """On a CPU without AVX512BW/VL/DQ or AVX_NE_CONVERT (an AVX2-only Zen 3) oneDNN's bf16
    reorder raises; a bf16 layer the tiles cannot take then stays a plain ``torch.mm`` (CI
    was red there). Patched here so that every CPU runs the branch."""
    from pagedllm.layers import linear as linear_module
    monkeypatch.delenv("PAGEDLLM_PACK_WEIGHTS", raising=False)
    monkeypatch.setattr(linear_module, "_onednn_bf16_supported", lambda: False)
    assert not packing_available(torch.bfloat16)
    in_features, out_features = shape
    linear = make_linear(torch.bfloat16, bias=True, in_features=in_features, out_features=out_features)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    expected = linear(x)
    assert not linear.pack() and linear.packed is None and linear.blocked is None
    assert torch.equal(linear(x), expected)


def test_weights_move_to_one_arena_unchanged():
    """Every parameter and buffer is copied into one arena, bitwise; a storage two different
    views share (a tied weight and its transpose) stays where it is, still shared."""
    model = torch.nn.Module()
    model.a, model.b = make_linear(torch.float32, bias=True), make_linear(torch.bfloat16, bias=False, seed=1)
    model.tied = torch.nn.Parameter(model.a.weight_t.t(), requires_grad=False)  # a second view
    model.register_buffer("steps", torch.arange(5))
    before = {name: t.clone() for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    tied_ptr = model.a.weight_t.data_ptr()
    moved = move_weights_to_huge_pages(model)
    assert moved == 64 * (-(-160 * 4 // 64) + -(-96 * 160 * 2 // 64) + -(-5 * 8 // 64))
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert model.a.weight_t.data_ptr() == tied_ptr == model.tied.data_ptr()
    arena = model.a.bias.untyped_storage().data_ptr()
    assert model.b.weight_t.untyped_storage().data_ptr() == model.steps.untyped_storage().data_ptr() == arena
    assert model.b.weight_t.data_ptr() % 64 == 0
