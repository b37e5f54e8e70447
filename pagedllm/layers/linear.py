"""Dense linear layer: its weight stored transposed, ``[in_features, out_features]``, or
pre-packed for oneDNN.

``torch.nn.functional.linear`` multiplies by a ``[out, in]`` weight through a transposed view,
and on an Intel Xeon without bf16 units (torch 2.13, MKL) that path was 3-4x slower than a
plain ``torch.mm`` by a ``[in, out]`` contiguous weight at 8-32 rows (``bench/linear_layout.py``).
Faster still is a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the packing torch's inductor does for CPU linears)
and multiplied by ``mkldnn::_linear_pointwise``: a plain bf16 ``torch.mm`` goes through oneDNN
too but reorders the weight at every call. Measured on an AMD EPYC (family 26, Zen 5 class, AVX512_BF16), 1
thread, a 576 x 3072 weight: bf16 78 -> 36 us at 1 row, 124 -> 82 at 16, 282 -> 234 at 64,
1842 -> 1751 at 512, bitwise equal; fp32 (MKL there takes its slow non-Intel path) 97 -> 55 us
at 1 row, 458 -> 196 at 16, 8457 -> 3756 at 512, equal to fp32 summation order. ``pack()``
switches a layer to that form where ``packing_available`` says so for its dtype and CPU.

bf16 weights, where the C++ ops are built and the CPU has no AMX (``amx_preferred``; the LM
head on every CPU), take a third form instead: ``blocked``, tiles of 32
output channels with each pair of inputs side by side (``block_bf16``), multiplied by the op
``bf16_linear`` (``csrc/quant_gemm.cpp``: AVX512_BF16 ``VDPBF16PS`` where the CPU has it). One
tile is one sequential stream through memory, which oneDNN's packed bf16 matmul does not
reach at decode batch sizes. On an AMD EPYC (Zen 4, AVX512_BF16), 2 threads, SmolLM2-135M's
120 layer matmuls (212 MB of weights, in 2 MiB pages) against oneDNN packed: 2.0-2.2x faster
at 1-4 rows, 1.0-1.2x at 16-64, 0.92-0.96x at 512-2048 (prefill), with one copy of the weights
(``bench/decode_matmuls.py``; bench/README.md, "Zen 4 profile, small batches").
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.layers.custom_op import CustomOp, native_ops
from pagedllm.platform import cpu_flags, cpu_vendor


def packing_available(dtype: torch.dtype) -> bool:
    """Whether ``Linear.pack`` pre-packs ``dtype`` weights on this CPU.

    bfloat16: where torch has oneDNN and oneDNN runs bf16 on this CPU (AVX512BW/VL/DQ or
    AVX_NE_CONVERT; elsewhere, as on an AVX2-only Zen 3, ``_reorder_linear_weight`` raises);
    a plain bf16 ``torch.mm`` reorders the weight at every call. float32: ``torch.mm`` is
    MKL's GEMM, which runs a generic path on CPUs that are not Intel's (oneDNN was 2-2.4x
    faster from 16 rows up on an AMD EPYC); on Intel CPUs it stays MKL, the path the fp32
    figures of an Ice Lake Xeon were measured with.
    ``PAGEDLLM_PACK_WEIGHTS=0`` turns packing off (and ``Linear.pack``'s bf16 tiles with it),
    ``=1`` forces it on for float32 as well.
    """
    setting = envs.PAGEDLLM_PACK_WEIGHTS
    if setting is False or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                                                 "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16:
        return _onednn_bf16_supported()
    return setting is True or cpu_vendor() != "GenuineIntel"


# The row count oneDNN lays a packed weight out for (``_reorder_linear_weight``'s batch size;
# vLLM's ``create_onednn_mm`` uses 32 too). Measured on an Intel Xeon with AMX (2 cores,
# 2026-12-05, alternated): against a layout for 1 row, the Llama-3.2-3B layer matmuls took
# 0.64-0.76x the time in bf16 at 1, 32 and 512 rows, SmolLM2-135M's 0.80-0.87x (fp32
# 0.82-1.02x), and a SmolLM2-1.7B prefill step of 2,048 tokens 0.81-0.87x; batch-1 decode
# steps were within the VM's noise (+2-23 % in 4 paired runs, bench/README.md).
ONEDNN_PACK_ROWS = 32


def amx_preferred() -> bool:
    """Whether bf16 weights go to oneDNN's packed layout rather than ``bf16_linear``'s tiles
    (and long prefill chunks to SDPA, ``attention.sdpa_is_faster``): on CPUs with AMX-BF16
    unless ``PAGEDLLM_BATCH_INVARIANT=1``. There oneDNN multiplies with AMX tiles: on an
    Intel Xeon with AMX (2 threads, 2026-12-04, ``bench/bf16_tiles_vs_onednn.py``, SmolLM2-1.7B
    layer shapes), 0.24-0.29x the tiles' time at 16 rows, 0.10-0.21x from 64 rows up (prefill),
    0.7-1.3x at one row over two runs; but its result for a row depends on the row count,
    which the tiles' does not."""
    return not envs.PAGEDLLM_BATCH_INVARIANT and _has_amx_bf16()


@functools.lru_cache(maxsize=1)
def _has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


@functools.lru_cache(maxsize=1)
def _onednn_bf16_supported() -> bool:
    """Whether oneDNN's bf16 kernels run on this CPU (torch's own check)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


BF16_TILE = 32  # output channels per tile of the blocked bf16 layout


def block_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[N / 32, K / 2, 32, 2]``, the layout of the op ``bf16_linear``:
    ``blocked[t, p, c, i] = weight[32 t + c, 2 p + i]``. N must be a multiple of 32, K even."""
    n, k = weight.shape
    return weight.reshape(n // BF16_TILE, BF16_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unblock_bf16(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of ``block_bf16``: the ``[N, K]`` weight (a copy)."""
    tiles, half, tile, _ = blocked.shape
    return blocked.permute(0, 2, 1, 3).reshape(tiles * tile, half * 2)


class BF16LinearOp(CustomOp):
    """``bf16_linear(x, blocked, bias, fp32_out)``: ``x @ W.T + bias`` for a bf16 weight ``W``
    laid out by ``block_bf16``; ``x`` ``[rows, K]`` bf16, ``bias`` ``[N]`` or None. The result is
    ``[rows, N]`` bf16, or with ``fp32_out`` the fp32 sums unrounded (the LM head's logits).

    ``forward_cpu`` is the C++ ``bf16_linear`` (``csrc/quant_gemm.cpp``); ``forward_native``
    multiplies by the unblocked weight (the path of the tests that turn the C++ ops off after
    a model was packed).
    """

    def __init__(self) -> None:
        super().__init__("bf16_linear")

    def forward_native(self, x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor],
                       fp32_out: bool = False) -> torch.Tensor:
        if fp32_out:
            return F.linear(x.float(), unblock_bf16(blocked).float(), None if bias is None else bias.float())
        return F.linear(x, unblock_bf16(blocked), bias)

    def forward_cpu(self, x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor],
                    fp32_out: bool = False) -> torch.Tensor:
        return torch.ops.pagedllm.bf16_linear(x, blocked, bias, False, fp32_out)


bf16_linear = BF16LinearOp()


def block_fp32(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[N / 32, K, 32]``, the layout of the op ``fp32_linear``:
    ``blocked[t, i, c] = weight[32 t + c, i]``. N must be a multiple of 32."""
    n, k = weight.shape
    return weight.reshape(n // BF16_TILE, BF16_TILE, k).permute(0, 2, 1).contiguous()


def unblock_fp32(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of ``block_fp32``: the ``[N, K]`` weight (a copy)."""
    tiles, k, tile = blocked.shape
    return blocked.permute(0, 2, 1).reshape(tiles * tile, k)


class FP32LinearOp(CustomOp):
    """``fp32_linear(x, blocked, bias)``: ``x @ W.T + bias`` in fp32 for a weight laid out by
    ``block_fp32``; ``x`` ``[rows, K]`` fp32, ``bias`` ``[N]`` fp32 or None; ``[rows, N]`` fp32.

    ``forward_cpu`` is the C++ ``fp32_linear`` (``csrc/quant_gemm.cpp``): each output sums its
    K products in input order with one FMA each, so a row's result is bitwise the same whatever
    the batch (torch's fp32 GEMM, MKL or oneDNN, sums in an order that depends on the row
    count). ``forward_native`` multiplies by the unblocked weight (close, not bitwise).
    """

    def __init__(self) -> None:
        super().__init__("fp32_linear")

    def forward_native(self, x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, unblock_fp32(blocked), bias)

    def forward_cpu(self, x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.pagedllm.fp32_linear(x, blocked, bias)


fp32_linear = FP32LinearOp()


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` for ``x`` ``[num_tokens, in_features]``.

    Attributes:
        weight_t: ``[in_features, out_features]`` in the compute dtype, contiguous (a transposed
            view of an ``[out_features, in_features]`` one while ``quantized_after_load``);
            None once packed.
        quantized_after_load: set by ``build_model`` on a layer that a quantization method
            replaces right after its weights load: ``set_weight`` then keeps the weight's rows
            in order, as the method reads them (two transposed copies fewer: ~40 % of a w4a8
            build of SmolLM2-1.7B, one thread).
        packed: the weight in oneDNN's blocked layout (an opaque ``[out, in]`` mkldnn tensor,
            not a parameter: it has no storage), or None.
        blocked: a bf16 weight as ``block_bf16`` lays it out (``[out / 32, in / 2, 32, 2]``), an
            fp32 one as ``block_fp32`` does (``[out / 32, in, 32]``), or None.
        bias: ``[out_features]`` or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quantized_after_load = False
        self.packed: Optional[torch.Tensor] = None
        self.blocked: Optional[torch.Tensor] = None

    @property
    def weight(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight: a view (no copy), or a dense copy of a
        packed or blocked weight."""
        if self.blocked is not None:
            return unblock_bf16(self.blocked) if self.blocked.dim() == 4 else unblock_fp32(self.blocked)
        return self.packed.to_dense() if self.packed is not None else self.weight_t.t()

    def pack(self, fp32_out: bool = False) -> bool:
        """Reorder the weight into ``bf16_linear``'s tiles (bf16, the C++ ops built,
        ``out_features`` a multiple of 32, ``in_features`` even; on CPUs with AMX only for
        ``fp32_out``, see ``amx_preferred``), ``fp32_linear``'s (fp32, the C++ ops built,
        ``out_features`` a multiple of 32) or else oneDNN's layout, and drop the plain copy.
        Returns whether it did (False with ``PAGEDLLM_PACK_WEIGHTS=0``, or where
        ``packing_available`` says no for its dtype).

        The fp32 tiles keep every row's result independent of its batch, and on an AMD EPYC
        Zen 4 (2 threads, SmolLM2-1.7B's shapes, 2026-12-07) ran 1.01-1.7x oneDNN's speed from
        16 to 2,048 rows, 0.88-1.26x at one, and 1.2-3.8x MKL's ``torch.mm``'s (bench/README.md, "fp32 weights in
        tiles").

        Args:
            fp32_out: the layer is called with ``out_dtype=torch.float32`` (the LM head): only
                the tiles hand over unrounded fp32 sums; oneDNN's bf16 product rounds logits to
                bf16, whose exact ties change greedy choices.
        """
        if self.packed is not None or self.blocked is not None:
            return True
        if envs.PAGEDLLM_PACK_WEIGHTS is False:
            return False
        if (self.weight_t.dtype == torch.bfloat16 and self.out_features % BF16_TILE == 0 and self.in_features % 2 == 0
                and native_ops() is not None
                and (fp32_out or not (amx_preferred() and packing_available(torch.bfloat16)))):
            self.blocked = nn.Parameter(block_bf16(self.weight_t.t()), requires_grad=False)
            self.weight_t = None
            return True
        if self.weight_t.dtype == torch.float32 and self.out_features % BF16_TILE == 0 and native_ops() is not None:
            self.blocked = nn.Parameter(block_fp32(self.weight_t.t()), requires_grad=False)
            self.weight_t = None
            return True
        if not packing_available(self.weight_t.dtype):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight_t.t().contiguous(), ONEDNN_PACK_ROWS)
        self.weight_t = None
        return True

    def set_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        """Install a ``[out_features, in_features]`` weight (any dtype), stored transposed.

        Raises:
            ValueError: the shape is not ``[out_features, in_features]``.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"expected a weight of shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        if self.quantized_after_load:
            self.weight_t = nn.Parameter(weight.to(dtype).contiguous().t(), requires_grad=False)
        else:
            self.weight_t = nn.Parameter(weight.to(dtype).t().contiguous(), requires_grad=False)
        self.packed = self.blocked = None

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``[rows, in_features]`` -> ``[rows, out_features]`` in ``x``'s dtype, or in
        ``out_dtype=torch.float32``: bf16 tiles then hand over their fp32 sums unrounded (the LM
        head's logits); the other paths compute in ``x``'s dtype and convert."""
        if self.blocked is not None and self.blocked.dim() == 3:
            return fp32_linear(x, self.blocked, self.bias)
        if self.blocked is not None:
            return bf16_linear(x, self.blocked, self.bias, out_dtype == torch.float32)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.bias is None:
            y = torch.mm(x, self.weight_t)
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        return y if out_dtype is None else y.to(out_dtype)

    def kernel_args(self) -> list[torch.Tensor]:
        """The tensors the C++ ``decode_layers`` op multiplies by: ``[weight_t, packed or
        blocked]`` (+ ``bias``); the op tells them apart by ``is_mkldnn`` and the 4-D (bf16) or
        3-D (fp32) shape of ``blocked``."""
        weight = self.blocked if self.blocked is not None else self.packed if self.packed is not None else self.weight_t
        return [weight] + ([] if self.bias is None else [self.bias])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

