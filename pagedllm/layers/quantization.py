"""Weight-only quantization of the linear layers: ``int8`` (per output channel) and ``int4``
(group-wise asymmetric, group 32), with pagedllm's C++ kernels for decode batches; and, with
int8 activations too, ``w8a8`` (``W8A8Linear``) and ``w4a8`` (``W4A8Linear``).

Formats (``W`` is a ``[N, K]`` weight, ``N`` output features, ``K`` input features):

- ``int8``: ``W[n, k] ~= scales[n] * q[n, k]``, ``q`` int8 in ``[-127, 127]``, ``scales`` fp32
  ``absmax(W[n]) / 127`` (symmetric, as vLLM's CPU ``int8`` weight-only path and
  ``torch.ao`` ``Int8WeightOnlyConfig``).
- ``int4``: ``W[n, k] ~= scales[n, g] * q[n, k] + mins[n, g]`` for ``g = k // 32``, ``q`` in
  ``[0, 15]``: the layout of GGUF ``Q4_1`` (llama.cpp ``ggml-quants.c``), and of each 32-wide
  sub-block of ``Q4_K`` (``scale = d * sc``, ``min = -dmin * m``), so both load without
  re-quantizing (``int4_from_q4_1``, ``int4_from_q4_k``). Any other weight is quantized with
  the group's min/max (``quantize_int4``).

Kernels (``pagedllm/csrc/quant_gemm.cpp``, measured by ``bench/quant_matmul.py``): for up to
``KERNEL_MAX_ROWS`` rows of ``x`` (decode batches) the C++ ops ``int8_linear`` / ``int4_linear``
read the stored codes and convert them to fp32 in registers, so a step reads 1 (int8) or ~0.75
(int4, with its fp32 scales and mins) bytes per weight instead of 4; activations and
accumulation stay fp32. Larger batches (prefill chunks) are compute-bound and dequantize the
weight, then call the fp32 GEMM. torch's own weight-only kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) were slower than these at every row count measured: they
are vectorized for bf16 activations only, and this CPU has no bf16 arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.layers.ops import native_ops

# pagedllm quantizes the float weights itself (int8, int4) or loads a checkpoint's own integer
# weights (vLLM's names for the formats; models/quantized_checkpoint.py reads them).
CHECKPOINT_QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors")
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "w4a8") + CHECKPOINT_QUANTIZATION_METHODS
INT4_GROUP_SIZE = 32
# SmoothQuant's migration strength. SmolLM2-135M, perplexity on 2,048 tokens of the shipped text
# (calibrated on the next 1,024): fp32 unquantized 18.50; W8A8 with alpha 0.5 19.78, 0.6 19.05,
# 0.65 18.36, 0.7 18.76, 0.8 18.61, 0.9 19.23; bf16 unquantized 18.55, W8A8 without smoothing
# 19.81, alpha 0.8 18.46. The curve is noisy; 0.8 is within 1 % in both dtypes.
W8A8_SMOOTHING_ALPHA = 0.8
# Rows of x up to which the quantized kernels beat dequantize-then-matmul (bench/quant_matmul.py).
KERNEL_MAX_ROWS = 64


@dataclass
class Int4Weight:
    """A group-32 asymmetric 4-bit weight in plain (unpacked) layout.

    Attributes:
        codes: ``[N, K]`` uint8 in ``[0, 15]``.
        scales, mins: ``[N, K // 32]`` fp32; ``W = scales * codes + mins`` per group.
        input_order: None, or ``[K]`` int64: column ``k`` here is input feature
            ``input_order[k]`` (a GPTQ act-order checkpoint, whose groups are not runs of
            consecutive features until its columns are sorted by group).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    input_order: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        """The ``[N, K]`` fp32 weight, ``scales * codes + mins`` (same op order as ``gguf``)."""
        n, k = self.codes.shape
        groups = self.codes.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE).float()
        return (self.scales[..., None] * groups + self.mins[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Stack along output channels (fused Q/K/V or gate/up).

        Raises:
            ValueError: the parts order their input features differently.
        """
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.mins for p in parts]), _common_input_order(parts))

    def permute_rows(self, index: np.ndarray) -> "Int4Weight":
        """Reorder output channels (groups run along input features, so rows move whole)."""
        index = torch.as_tensor(index)
        return Int4Weight(self.codes[index], self.scales[index], self.mins[index], self.input_order)


@dataclass
class Int8Weight:
    """An int8 weight read from a checkpoint: ``W = scales * codes``.

    Attributes:
        codes: ``[N, K]`` int8 (the full ``[-128, 127]``; pagedllm's own stop at -127).
        scales: ``[N]`` fp32 per output channel, or ``[N, K // 32]`` per 32-weight group.
        input_order: as ``Int4Weight.input_order``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    input_order: Optional[torch.Tensor] = None

    @staticmethod
    def cat(parts: list["Int8Weight"]) -> "Int8Weight":
        """Stack along output channels (fused Q/K/V or gate/up); see ``Int4Weight.cat``."""
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          _common_input_order(parts))


def _common_input_order(parts: list) -> Optional[torch.Tensor]:
    order = parts[0].input_order
    for part in parts[1:]:
        if (order is None) != (part.input_order is None) or (order is not None and
                                                            not torch.equal(order, part.input_order)):
            raise ValueError("layers fused into one projection (q/k/v or gate/up) order their input "
                             "features differently (act-order g_idx); pagedllm needs one order per "
                             "fused projection")
    return order


def quantize_int8(weight: torch.Tensor, grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: ``[N, K]`` float -> (``[N, K]`` int8 codes, fp32 scales).

    Scales are ``[N]`` (``absmax`` of each output channel / 127) or, with ``grouped``,
    ``[N, K / 32]`` per 32-weight group: GGUF ``Q8_0``'s recipe (llama.cpp
    ``quantize_row_q8_0``), so a weight dequantized from a ``Q8_0`` file gets its own codes and
    scales back exactly. A group or row of zeros gets scale 1 (its codes are 0 either way).

    Raises:
        ValueError: ``grouped`` and ``K`` is not a multiple of 32.
    """
    weight = weight.float()
    n, k = weight.shape
    if grouped:
        if k % INT4_GROUP_SIZE:
            raise ValueError(f"grouped int8 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
        weight = weight.view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    scales = weight.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(weight / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(n, k), scales


def quantize_int4(weight: torch.Tensor, half_scales: bool = False) -> Int4Weight:
    """Group-32 min/max asymmetric 4-bit (the ``Q4_1`` recipe of llama.cpp, fp32 scale and min;
    with ``half_scales`` both are rounded to fp16 before the codes are chosen, as ``Q4_1``
    stores them).

    Raises:
        ValueError: ``K`` (``weight.shape[1]``) is not a multiple of 32.
    """
    n, k = weight.shape
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
    groups = weight.float().reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    mins = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - mins) / 15.0
    if half_scales:
        mins, scales = mins.half().float(), scales.half().float()
    inverse = torch.where(scales == 0, torch.zeros_like(scales), 1.0 / scales)
    codes = torch.round((groups - mins[..., None]) * inverse[..., None]).clamp_(0, 15)
    return Int4Weight(codes.to(torch.uint8).view(n, k), scales, mins)


def int4_from_q4_1(blocks: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """Codes, scales and mins of a GGUF ``Q4_1`` tensor, without dequantizing.

    A ``Q4_1`` block is 20 bytes for 32 consecutive weights of a row: fp16 ``d``, fp16 ``m``,
    16 bytes whose low nibbles are weights 0-15 and high nibbles weights 16-31;
    ``w = d * q + m`` (llama.cpp ``dequantize_row_q4_1``; ``gguf.quants.Q4_1``).

    Args:
        blocks: the tensor's raw bytes (any shape, uint8), ``N * K / 32`` blocks.
        shape: ``(N, K)`` in row-major (Hugging Face) order.
    """
    n, k = shape
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return Int4Weight(torch.from_numpy(codes.reshape(n, k)),
                      torch.from_numpy(d.reshape(n, k // 32)), torch.from_numpy(m.reshape(n, k // 32)))


def int4_from_q4_k(blocks: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """Codes, scales and mins of a GGUF ``Q4_K`` tensor, without dequantizing.

    A ``Q4_K`` super-block is 144 bytes for 256 weights: fp16 ``d`` and ``dmin``, 12 bytes of
    eight 6-bit sub-block scales ``sc`` and mins ``m``, then 128 bytes where byte ``i`` of the
    ``j``-th 32-byte run holds weight ``i`` of sub-block ``2j`` (low nibble) and ``2j + 1``
    (high nibble); ``w = (d * sc) * q - dmin * m`` per 32-weight sub-block (llama.cpp
    ``dequantize_row_q4_K``; ``gguf.quants.Q4_K``, whose scale unpacking is reused).
    """
    from gguf.quants import Q4_K

    n, k = shape
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 144)
    num_blocks = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scales = d * sc.astype(np.float32)
    mins = -(dmin * m.astype(np.float32))
    packed = blocks[:, 16:].reshape(num_blocks, 4, 1, 32)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [blocks, 4, 2, 32]
    return Int4Weight(torch.from_numpy(codes.reshape(n, k)),
                      torch.from_numpy(scales.reshape(n, k // 32)), torch.from_numpy(mins.reshape(n, k // 32)))


class _QuantizedLinear(nn.Module):
    """What ``Int8Linear`` and ``Int4Linear`` share: an fp32 ``bias`` (or None), the C++ kernel
    ``_op`` for decode-sized batches fed the buffers ``_weight_names``, and dequantize-then-GEMM
    for larger ones.

    ``forward(x, out_dtype=None)`` takes ``x`` ``[M, K]`` (fp32 or bf16) and returns ``[M, N]``
    in ``out_dtype`` (default: ``x``'s dtype). With an ``input_order`` (``[K]`` int64, a GPTQ
    act-order checkpoint) the weight's columns are stored sorted by group, and ``x``'s columns
    are gathered into that order first; ``decode_layers`` does not gather, so such a model
    runs its Python layers (``quantize_model`` turns ``fused_decode`` off). Up to ``KERNEL_MAX_ROWS`` rows the product is
    computed in fp32 from the exact stored weights whatever ``x``'s dtype, by the kernel or,
    without the C++ ops, by the same fp32 formulation in torch, so both paths agree to fp32
    summation order in every compute dtype. Larger batches multiply in ``x``'s dtype (a bf16
    GEMM by the weight rounded to bf16).
    """

    _op: str
    _weight_names: tuple[str, ...]

    def _set_bias(self, bias: Optional[torch.Tensor], input_order: Optional[torch.Tensor] = None) -> None:
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("input_order", None if input_order is None else input_order.long().contiguous())

    def kernel_args(self) -> list[torch.Tensor]:
        """The tensors the C++ ``decode_layers`` op takes for this layer: its weights (+ ``bias``)."""
        return [getattr(self, name) for name in self._weight_names] + ([] if self.bias is None else [self.bias])

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if _kernel_rows(x, self.in_features):
            ops = native_ops()
            if ops is not None:
                weights = [getattr(self, name) for name in self._weight_names]
                y = getattr(ops, self._op)(x.float().contiguous(), *weights, self.bias)
            else:
                y = torch.mm(x.float(), self.dequantize(torch.float32).t())
                y = y if self.bias is None else y + self.bias
            return y.to(out_dtype)
        y = torch.mm(x, self.dequantize(x.dtype).t())
        return (y if self.bias is None else y + self.bias.to(x.dtype)).to(out_dtype)


class Int8Linear(_QuantizedLinear):
    """``y = x @ (scales * q).T + bias`` with int8 ``q`` ``[N, K]`` and fp32 ``scales``, ``[N]``
    per output channel or ``[N, K / 32]`` per 32-weight group (``quantize_int8``).

    """

    _op, _weight_names = "int8_linear", ("codes", "scales")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor],
                 input_order: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self._set_bias(bias, input_order)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], grouped: bool = False) -> "Int8Linear":
        return cls(*quantize_int8(weight, grouped), bias)

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (``[T]`` int64) of the weight, ``[T, K]`` in ``dtype`` (an embedding lookup)."""
        codes, scales = self.codes[index].float(), self.scales[index]
        if scales.dim() == 1:
            return (codes * scales[:, None]).to(dtype)
        groups = codes.view(len(index), -1, INT4_GROUP_SIZE) * scales[..., None]
        return groups.view(len(index), self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the layer multiplies by, in ``dtype`` (one C++ pass when built)."""
        ops = native_ops()
        if ops is not None:
            return ops.int8_dequantize(self.codes, self.scales).to(dtype)
        return self.rows(torch.arange(self.out_features), dtype)


class Int4Linear(_QuantizedLinear):
    """``y = x @ W.T + bias`` with ``W`` group-32 asymmetric 4-bit, ``W = scales * q + mins``.

    Holds ``packed`` (``[N, K / 2]`` uint8: in each 32-weight group, byte ``i`` has weight ``i``
    in its low nibble and weight ``i + 16`` in its high nibble, GGUF ``Q4_1``'s order) and
    ``scales``, ``mins`` (``[N, K / 32]`` fp32).
    """

    _op, _weight_names = "int4_linear", ("packed", "scales", "mins")

    def __init__(self, weight: Int4Weight, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        n, k = weight.codes.shape
        self.out_features, self.in_features = n, k
        halves = weight.codes.view(n, k // INT4_GROUP_SIZE, 2, INT4_GROUP_SIZE // 2)
        self.register_buffer("packed", (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("mins", weight.mins.float().contiguous())
        self._set_bias(bias, weight.input_order)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "Int4Linear":
        return cls(quantize_int4(weight), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the layer multiplies by, in ``dtype`` (one C++ pass when built)."""
        ops = native_ops()
        if ops is not None:
            return ops.int4_dequantize(self.packed, self.scales, self.mins).to(dtype)
        n, k = self.out_features, self.in_features
        packed = self.packed.view(n, k // INT4_GROUP_SIZE, 1, INT4_GROUP_SIZE // 2)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=2).view(n, k).contiguous()
        return Int4Weight(codes, self.scales, self.mins).dequantize().to(dtype)


W8A8_TILE = 16  # output channels per tile of the blocked W8A8 layout


def block_w8a8(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` int8 in the layout of ``csrc/w8a8.cpp``: ``[ceil(N / 16), ceil(K / 4), 64]``
    uint8, where byte ``4 ch + i`` of ``[t, j]`` is ``codes[16 t + ch, 4 j + i] + 128`` (one 64-byte
    load gives 16 channels x 4 inputs, VPDPBUSD's unsigned operand); padding holds 128 (code 0)."""
    n, k = codes.shape
    tiles, steps = -(-n // W8A8_TILE), -(-k // 4)
    unsigned = torch.full((tiles * W8A8_TILE, steps * 4), 128, dtype=torch.uint8)
    unsigned[:n, :k] = (codes.to(torch.int16) + 128).to(torch.uint8)
    return unsigned.view(tiles, W8A8_TILE, steps, 4).permute(0, 2, 1, 3).reshape(tiles, steps, 64).contiguous()


def unblock_w8a8(blocked: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of ``block_w8a8`` for an ``[n, k]`` weight: codes ``[n, k]`` int8."""
    tiles, steps, _ = blocked.shape
    unsigned = blocked.view(tiles, steps, W8A8_TILE, 4).permute(0, 2, 1, 3).reshape(tiles * W8A8_TILE, steps * 4)
    return (unsigned[:n, :k].to(torch.int16) - 128).to(torch.int8).contiguous()


def w8a8_linear_torch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, smooth_inv: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the C++ ``w8a8_linear`` (``csrc/w8a8.cpp``), bitwise equal to it.

    Each row of ``x * smooth_inv`` is quantized to int8 with its own scale (``absmax / 127``,
    round half to even), multiplied by ``codes`` in int32 (``torch._int_mm``: exact), and the
    result is scaled back as ``(acc * x_scale) * scales + bias``.

    Args:
        x: ``[M, K]`` float32 or bfloat16.
        codes: ``[ceil(N / 16), ceil(K / 4), 64]`` uint8 (``block_w8a8``); scales: ``[N]`` fp32;
        smooth_inv: ``[1, K]`` fp32; bias: ``[N]`` fp32 or None.

    Returns: ``[M, N]`` in ``x``'s dtype.
    """
    codes = unblock_w8a8(codes, scales.shape[0], x.shape[1])
    v = x.float() * smooth_inv
    amax = v.abs().amax(dim=1, keepdim=True)
    x_scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    x_scales = torch.where(v.isfinite().all(dim=1, keepdim=True), x_scales, torch.nan)  # NaN in, NaN out
    q = torch.round(v / x_scales).clamp_(-127, 127).to(torch.int8)
    y = torch._int_mm(q, codes.t()).float() * x_scales * scales
    return (y if bias is None else y + bias).to(x.dtype)


class W8A8Linear(nn.Module):
    """``y ~= x @ W.T + bias`` in int8 x int8 (``quantization="w8a8"``): SmoothQuant (Xiao et al.
    2023, sections 3-4) with per-token dynamic activation scales, as vLLM's CPU W8A8 path.

    The weight is stored as ``W * s`` quantized per output channel (``quantize_int8``), where
    the smoothing factor ``s[k] = amax_x[k] ** alpha / amax_w[k] ** (1 - alpha)`` moves the
    activation outliers of input channel ``k`` into the weight; ``x`` is multiplied by
    ``smooth_inv = 1 / s`` as it is quantized. ``amax_x`` comes from a calibration pass
    (``layers/smooth_quant.py``); without one ``s`` is 1. Every batch size takes the same
    integer path, so a row's result does not depend on the other rows of the batch.

    The C++ op (``csrc/w8a8.cpp``) multiplies with VPDPBUSD over codes blocked by 16 output
    channels x 4 inputs (``block_w8a8``). On an AMD EPYC Zen 4 (2 threads, AVX512_VNNI) it took
    the 120 layer matmuls of a SmolLM2 decode step (106 MB of codes, out of cache) in ~26 ms at
    64 rows and ~12 ms at 16, against ~35-38 and ~21-27 ms through oneDNN's ``_int_mm`` on
    ``[N, K]`` codes (which reorders the weight on every call), and as fast at 2,048 rows.

    Attributes:
        codes: ``[ceil(N / 16), ceil(K / 4), 64]`` uint8, the int8 codes in ``[-127, 127]`` + 128
            (``block_w8a8``; ``int8_codes()`` gives them as ``[N, K]``); scales: ``[N]`` fp32;
            smooth_inv: ``[1, K]`` fp32; bias: ``[N]`` fp32 or None.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, smooth_inv: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", block_w8a8(codes))
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("smooth_inv", smooth_inv.float().reshape(1, self.in_features).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   activation_absmax: Optional[torch.Tensor] = None,
                   alpha: float = W8A8_SMOOTHING_ALPHA) -> "W8A8Linear":
        """Quantize a ``[N, K]`` float weight, smoothed by ``activation_absmax`` (``[K]`` fp32,
        the largest ``|x[:, k]|`` seen in calibration) with migration strength ``alpha``."""
        weight = weight.float()
        if activation_absmax is None:
            smooth = torch.ones(weight.shape[1])
        else:
            smooth = (activation_absmax.float().clamp(min=1e-5) ** alpha
                      / weight.abs().amax(dim=0).clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
        codes, scales = quantize_int8(weight * smooth)
        return cls(codes, scales, 1 / smooth, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the layer stands for, ``scales * codes * smooth_inv``."""
        return (self.int8_codes().float() * self.scales[:, None] * self.smooth_inv).to(dtype)

    def int8_codes(self) -> torch.Tensor:
        """The codes as ``[N, K]`` int8."""
        return unblock_w8a8(self.codes, self.out_features, self.in_features)

    def kernel_args(self) -> list[torch.Tensor]:
        """The tensors ``decode_layers`` takes for this layer: codes, scales, smooth_inv (+ bias)."""
        return [self.codes, self.scales, self.smooth_inv] + ([] if self.bias is None else [self.bias])

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x`` ``[M, K]`` float32 or bfloat16 -> ``[M, N]`` in ``out_dtype`` (default ``x``'s)."""
        ops = native_ops()
        args = (self.codes, self.scales, self.smooth_inv, self.bias)
        y = ops.w8a8_linear(x, *args) if ops is not None else w8a8_linear_torch(x, *args)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


W4A8_TILE = 16  # output channels per tile of the W4A8 layout


def block_w4a8(weight: Int4Weight) -> torch.Tensor:
    """An ``Int4Weight`` in the layout of ``csrc/w4a8.cpp``: ``[N / 16, K / 32, 320]`` uint8.

    For each tile of 16 output channels and each 32-input group: 256 code bytes, where byte
    ``64 j + 4 ch + i`` holds code ``[ch, 32 g + 4 j + i]`` in its low nibble and
    ``[ch, 32 g + 16 + 4 j + i]`` in its high nibble, then the 16 scales and the 16 mins as
    fp16 (rounded from the weight's fp32 ones, as GGUF ``Q4_1`` stores them).

    Raises:
        ValueError: ``N`` not a multiple of 16, ``K`` not of 32, or an ``input_order``.
    """
    n, k = weight.codes.shape
    if n % W4A8_TILE or k % INT4_GROUP_SIZE or weight.input_order is not None:
        raise ValueError(f"w4a8 needs out_features divisible by {W4A8_TILE} and in_features by "
                         f"{INT4_GROUP_SIZE}, in their own order; got a [{n}, {k}] weight"
                         + (" with an input order" if weight.input_order is not None else ""))
    tiles, groups = n // W4A8_TILE, k // INT4_GROUP_SIZE
    codes = weight.codes.view(tiles, W4A8_TILE, groups, 2, 4, 4)  # [tile, ch, group, half, j, i]
    packed = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, j, ch, i]

    def halves(t: torch.Tensor) -> torch.Tensor:  # [N, groups] fp32 -> [tiles, groups, 32] bytes
        return t.half().view(tiles, W4A8_TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([packed.reshape(tiles, groups, 256), halves(weight.scales), halves(weight.mins)], dim=2).contiguous()


def unblock_w4a8(blocked: torch.Tensor) -> Int4Weight:
    """The inverse of ``block_w4a8``: codes ``[N, K]`` uint8, scales and mins ``[N, K / 32]`` fp32
    (the fp16 values, widened)."""
    tiles, groups, _ = blocked.shape
    packed = blocked[:, :, :256].reshape(tiles, groups, 4, W4A8_TILE, 4).permute(0, 3, 1, 2, 4)  # [tile, ch, group, j, i]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=3)  # [tile, ch, group, half, j, i]

    def floats(part: torch.Tensor) -> torch.Tensor:
        return part.contiguous().view(torch.float16).transpose(1, 2).reshape(tiles * W4A8_TILE, groups).float()

    return Int4Weight(codes.reshape(tiles * W4A8_TILE, groups * INT4_GROUP_SIZE).contiguous(),
                      floats(blocked[:, :, 256:288]), floats(blocked[:, :, 288:]))


def w4a8_linear_torch(x: torch.Tensor, blocked: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the C++ ``w4a8_linear`` (``csrc/w4a8.cpp``): the same activation codes
    and integer dot products, the fp32 scaling rounded separately (the kernel fuses it), so the
    two agree to fp32 rounding.

    Args:
        x: ``[M, K]`` float32 or bfloat16; blocked: ``[N / 16, K / 32, 320]`` uint8
            (``block_w4a8``) or ``[N / 16, K / 32, 576]`` (``block_q8_0``); bias: ``[N]`` fp32
            or None.

    Returns: ``[M, N]`` in ``x``'s dtype.
    """
    if blocked.shape[2] == Q8_0_GROUP_BYTES:  # W = d * (c + 128) - 128 d, as the kernel takes it
        codes, scales = unblock_q8_0(blocked)
        weight = Int4Weight((codes.to(torch.int16) + 128).to(torch.uint8), scales, scales * -128)
    else:
        weight = unblock_w4a8(blocked)
    m, k = x.shape
    groups = k // INT4_GROUP_SIZE
    v = x.float().view(m, groups, INT4_GROUP_SIZE)
    amax = v.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    s = torch.where(v.isfinite().all(dim=-1), s, torch.nan)  # NaN or inf in, NaN out
    q = torch.round(v / s[..., None]).clamp_(-127, 127)
    sums = s * q.sum(dim=-1)  # exact integers below 2 ** 24, then one fp32 product
    codes = weight.codes.float().view(-1, groups, INT4_GROUP_SIZE)
    y = torch.zeros(m, codes.shape[0])
    for g in range(groups):
        dot = q[:, g] @ codes[:, g].t()  # integers below 2 ** 24: exact in fp32
        y = y + dot * (weight.scales[:, g] * s[:, g:g + 1]) + weight.mins[:, g] * sums[:, g:g + 1]
    return (y if bias is None else y + bias).to(x.dtype)


class W4A8Linear(nn.Module):
    """``y ~= x @ W.T + bias`` with 4-bit weights and int8 activations (``quantization="w4a8"``):
    GGUF ``Q4_1`` weights (group 32, fp16 scale and min) times activations quantized per token
    and 32-input group (``Q8_1``), multiplied in integers by the CPU's u8 x s8 dot product
    (VPDPBUSD; VPMADDUBSW without AVX512_VNNI): llama.cpp's ``Q4_1 x Q8_1`` dot. Formula and
    layout: ``csrc/w4a8.cpp``. Every batch size (decode, prefill) takes the same kernel, so a
    row's result does not depend on the other rows.

    Attributes:
        blocked: ``[N / 16, K / 32, 320]`` uint8 (``block_w4a8``); bias: ``[N]`` fp32 or None.

    Raises:
        ValueError: (constructor) ``N`` not a multiple of 16 or ``K`` of 32.
    """

    def __init__(self, weight: Int4Weight, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("blocked", block_w4a8(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "W4A8Linear":
        return cls(quantize_int4(weight, half_scales=True), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the layer stands for, ``scales * codes + mins``."""
        return unblock_w4a8(self.blocked).dequantize().to(dtype)

    def kernel_args(self) -> list[torch.Tensor]:
        """The tensors ``decode_layers`` takes for this layer: ``blocked`` (+ bias)."""
        return [self.blocked] + ([] if self.bias is None else [self.bias])

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x`` ``[M, K]`` float32 or bfloat16 -> ``[M, N]`` in ``out_dtype`` (default ``x``'s)."""
        ops = native_ops()
        y = ops.w4a8_linear(x, self.blocked, self.bias) if ops is not None else w4a8_linear_torch(x, self.blocked, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


Q8_0_GROUP_BYTES = 576  # bytes per tile of 16 channels and 32-input group in ``block_q8_0``


def block_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A grouped int8 weight (``quantize_int8(grouped=True)``: GGUF ``Q8_0``) in the 8-bit layout
    of ``csrc/w4a8.cpp``: ``[N / 16, K / 32, 576]`` uint8.

    For each tile of 16 output channels and each 32-input group: 512 bytes, byte
    ``64 j + 4 ch + i`` holding ``codes[ch, 32 g + 4 j + i] + 128`` (unsigned, for VPDPBUSD),
    then the 16 channels' scales as fp32.

    Args:
        codes: ``[N, K]`` int8 in ``[-127, 127]``; scales: ``[N, K / 32]`` fp32.

    Raises:
        ValueError: ``N`` not a multiple of 16, or ``K`` not of 32.
    """
    n, k = codes.shape
    if n % W4A8_TILE or k % INT4_GROUP_SIZE:
        raise ValueError(f"a q8_0 layer needs out_features divisible by {W4A8_TILE} and in_features by "
                         f"{INT4_GROUP_SIZE}; got a [{n}, {k}] weight")
    tiles, groups = n // W4A8_TILE, k // INT4_GROUP_SIZE
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    unsigned = unsigned.view(tiles, W4A8_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [tile, group, j, ch, i]
    d = scales.float().view(tiles, W4A8_TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([unsigned.reshape(tiles, groups, 512), d], dim=2).contiguous()


def unblock_q8_0(blocked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``block_q8_0``: codes ``[N, K]`` int8 and scales ``[N, K / 32]`` fp32."""
    tiles, groups, _ = blocked.shape
    unsigned = blocked[:, :, :512].reshape(tiles, groups, 8, W4A8_TILE, 4).permute(0, 3, 1, 2, 4)
    codes = (unsigned.to(torch.int16) - 128).to(torch.int8).reshape(tiles * W4A8_TILE, groups * INT4_GROUP_SIZE)
    scales = blocked[:, :, 512:].contiguous().view(torch.float32).transpose(1, 2).reshape(tiles * W4A8_TILE, groups)
    return codes.contiguous(), scales.contiguous()


class Q8_0Linear(nn.Module):
    """``y ~= x @ W.T + bias`` with GGUF ``Q8_0`` weights (int8, an fp32 scale per 32-weight
    group) times activations quantized per token and 32-input group (``Q8_1``): llama.cpp's
    ``Q8_0 x Q8_0`` dot, by the same C++ op as ``W4A8Linear`` (``csrc/w4a8.cpp``, 8-bit layout).

    The LM head (and the embedding rows it is tied to) under ``w4a8`` and ``w8a8``. On the Zen 4
    of bench/README.md (2 threads, AVX512_VNNI) SmolLM2's head took 1.32 ms at one row and
    10.1 ms at 64 rows this way, against 1.44 / 32.9 ms as a weight-only grouped int8 layer
    (fp32 FMAs) and 2.04 / 12.4 ms as a packed bf16 one. The weights are those of the grouped
    int8 head of ``int8`` / ``int4`` (``quantize_int8(grouped=True)``); only the activations'
    int8 rounding per 32 inputs is new.

    Attributes:
        blocked: ``[N / 16, K / 32, 576]`` uint8 (``block_q8_0``); bias: ``[N]`` fp32 or None.

    Raises:
        ValueError: (constructor) ``N`` not a multiple of 16 or ``K`` of 32.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("blocked", block_q8_0(codes, scales))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._row_words: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # rows()' word offsets

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "Q8_0Linear":
        return cls(*quantize_int8(weight, grouped=True), bias)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether a ``[N, K]`` weight has whole tiles and groups (``N % 16 == K % 32 == 0``)."""
        return weight.shape[0] % W4A8_TILE == 0 and weight.shape[1] % INT4_GROUP_SIZE == 0

    def rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``index`` (``[T]`` int64) of the weight, ``[T, K]`` in ``dtype`` (an embedding
        lookup; the values of ``Int8Linear.rows`` for the same codes and scales). The C++
        ``q8_0_rows`` where the ops are built (bitwise the same; one call instead of ~12 ops).

        Raises:
            ValueError: an index outside ``[0, out_features)`` (C++ op; torch raises IndexError).
        """
        ops = native_ops()
        if ops is not None:
            return ops.q8_0_rows(self.blocked, index, dtype)
        # Read only the row's words: each group of a tile is 144 32-bit words, word 16 j + ch
        # holding channel ch's codes 4j .. 4j + 3 and word 128 + ch its scale.
        groups = self.in_features // INT4_GROUP_SIZE
        words = Q8_0_GROUP_BYTES // 4
        if self._row_words is None:
            group_start = torch.arange(groups) * words
            self._row_words = (group_start[:, None] + W4A8_TILE * torch.arange(8), group_start + 128)
        code_words, scale_words = self._row_words
        start = (index // W4A8_TILE) * (groups * words) + index % W4A8_TILE  # [T]
        flat = self.blocked.view(-1)
        codes = flat.view(torch.int32)[start[:, None, None] + code_words].view(torch.uint8)
        codes = codes.view(index.shape[0], groups, INT4_GROUP_SIZE)
        scales = flat.view(torch.float32)[start[:, None] + scale_words][..., None]
        return ((codes.float() - 128) * scales).view(index.shape[0], self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight, ``scales * codes`` per group."""
        codes, scales = unblock_q8_0(self.blocked)
        groups = codes.float().view(self.out_features, -1, INT4_GROUP_SIZE) * scales[..., None]
        return groups.view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x`` ``[M, K]`` float32 or bfloat16 -> ``[M, N]`` in ``out_dtype`` (default ``x``'s);
        an fp32 ``out_dtype`` gets the fp32 sums unrounded (the activation codes are the same
        for ``x`` and ``x.float()``)."""
        if out_dtype == torch.float32:
            x = x.float()
        ops = native_ops()
        y = ops.w4a8_linear(x, self.blocked, self.bias) if ops is not None else w4a8_linear_torch(x, self.blocked, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """A token embedding that looks up rows of a grouped ``Int8Linear`` or a ``Q8_0Linear`` (the
    LM head's, when the two are tied, so one int8 copy serves both). ``forward``: ``[T]`` int64
    ids -> ``[T, hidden]`` in ``dtype``."""

    def __init__(self, table: "Int8Linear | Q8_0Linear", dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids, self.dtype)


def _kernel_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` is a decode-sized batch that the quantized kernels handle."""
    return x.dim() == 2 and x.shape[0] <= KERNEL_MAX_ROWS and in_features % INT4_GROUP_SIZE == 0


def quantize_model(model: nn.Module, prequantized: Optional[dict[str, "Int4Weight | Int8Weight"]] = None,
                   calibration_token_ids: Optional[list[int]] = None) -> None:
    """Replace every linear layer of the decoder layers by its quantized form, in place, by the
    method the model was built with (``model.quantization``).

    ``int8`` / ``int4``: pagedllm quantizes the float weights. The token embedding and the LM
    head become int8 with a scale per 32-weight group (one copy when tied): at one decode
    token the fp32 head was as many bytes as all the decoder layers in int8. Per-channel int8
    there was too coarse (the int4 SmolLM2 stopped answering "What is the capital of France?"
    with Paris: its logits moved 2.7% against 0.3% from the int4 layers alone); per group it
    is GGUF ``Q8_0``, the type SmolLM2's file stores its embedding in, so that file's values
    are kept exactly.

    ``w8a8``: every decoder linear layer becomes a ``W8A8Linear``, smoothed by the activation
    ranges of one forward pass of the float model over ``calibration_token_ids``
    (``layers/smooth_quant.py``). Under ``w8a8`` and ``w4a8`` the LM head (and the embedding
    it is tied to) is a ``Q8_0Linear``: the same grouped int8 weights as ``int8``'s head,
    times int8 activations per 32 inputs (a head whose shape does not split into its tiles
    stays as before: in the compute dtype under ``w8a8``, a grouped ``Int8Linear`` under
    ``w4a8``).

    ``awq`` / ``gptq`` / ``compressed-tensors``: the checkpoint's own integer weights
    (``prequantized``, read by ``models/quantized_checkpoint.py``) replace the layers they
    name; a projection the checkpoint left in float (its ignore list) stays float, and so do
    the embedding and LM head, as those checkpoints store them.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass) with weights installed (for a checkpoint
            method, the quantized projections' float weights may be meta placeholders).
        calibration_token_ids: ``w8a8`` only: the calibration text's token ids (none: no
            smoothing).
        prequantized: weights by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``):
            ``Int4Weight`` for ``int4`` (GGUF 4-bit; a fused layer uses them when every part is
            there, else quantizes its float weight) and the checkpoint methods, ``Int8Weight``
            for the 8-bit checkpoint methods.

    Raises:
        ValueError: unknown ``method``, a layer whose ``in_features`` does not split into
            groups of 32 (``int4``), or a fused projection that a checkpoint quantized only
            in part or with different input orders.
    """
    method = model.quantization
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}")
    prequantized = prequantized or {}
    from_checkpoint = method in CHECKPOINT_QUANTIZATION_METHODS
    if not from_checkpoint:
        model.unquantized_weight_bytes = weight_bytes(model)
    activation_absmax = {}
    if method == "w8a8" and calibration_token_ids:
        from pagedllm.layers.smooth_quant import collect_input_absmax

        activation_absmax = collect_input_absmax(model, calibration_token_ids)

    def convert(linear: Linear, hf_parts: list[str]) -> nn.Module:
        parts = [prequantized.get(name) for name in hf_parts]
        if from_checkpoint:
            if all(p is None for p in parts):
                return linear
            if any(p is None for p in parts) or len({type(p) for p in parts}) > 1:
                raise ValueError(f"{hf_parts} are fused into one projection, but the checkpoint "
                                 "quantizes only some of them, or not all alike")
            if isinstance(parts[0], Int8Weight):
                weight = Int8Weight.cat(parts)
                return Int8Linear(weight.codes, weight.scales, linear.bias, weight.input_order)
            return Int4Linear(Int4Weight.cat(parts), linear.bias)
        if method == "int8":
            return Int8Linear.from_float(linear.weight, linear.bias)
        if method == "w8a8":
            return W8A8Linear.from_float(linear.weight, linear.bias, activation_absmax.get(linear))
        if method == "w4a8":
            if all(p is not None for p in parts):
                return W4A8Linear(Int4Weight.cat(parts), linear.bias)
            return W4A8Linear.from_float(linear.weight, linear.bias)
        if all(p is not None for p in parts):
            return Int4Linear(Int4Weight.cat(parts), linear.bias)
        return Int4Linear.from_float(linear.weight, linear.bias)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = convert(attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        attn.o_proj = convert(attn.o_proj, [p + "self_attn.o_proj.weight"])
        if hasattr(mlp, "experts"):  # a MoE block (models/moe.py): each expert as a dense MLP, router float
            for e, expert in enumerate(mlp.experts):
                expert.gate_up_proj = convert(expert.gate_up_proj, [p + f"mlp.experts.{e}.gate_up_proj.weight"])
                expert.down_proj = convert(expert.down_proj, [p + f"mlp.experts.{e}.down_proj.weight"])
            continue
        mlp.gate_up_proj = convert(mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        mlp.down_proj = convert(mlp.down_proj, [p + "mlp.down_proj.weight"])
    if model.fused_decode is not None:  # None: a family the C++ decode op does not run (Gemma 3)
        model.fused_decode.invalidate()
    if from_checkpoint:
        quantized = [m for m in model.modules() if isinstance(m, _QuantizedLinear)]
        # What the same layers would take as float weights in the compute dtype.
        model.unquantized_weight_bytes = weight_bytes(model) + sum(
            m.out_features * m.in_features * model.dtype.itemsize
            - sum(t.numel() * t.element_size() for t in m.buffers() if t is not None and t is not m.bias)
            for m in quantized)
        if model.fused_decode is not None and any(m.input_order is not None for m in quantized):
            model.fused_decode.enabled = False  # decode_layers has no input gather
        return
    tied = model.embed_tokens.weight.untyped_storage().data_ptr() == model.lm_head.weight_t.untyped_storage().data_ptr()
    embedding = model.embed_tokens.weight
    if method in ("w8a8", "w4a8") and Q8_0Linear.fits(model.lm_head.weight) and Q8_0Linear.fits(embedding):
        model.lm_head = Q8_0Linear.from_float(model.lm_head.weight, model.lm_head.bias)
        table = model.lm_head if tied else Q8_0Linear.from_float(embedding, None)
    elif method == "w8a8":
        return
    else:
        model.lm_head = Int8Linear.from_float(model.lm_head.weight, model.lm_head.bias, grouped=True)
        table = model.lm_head if tied else Int8Linear.from_float(embedding, None, grouped=True)
    model.embed_tokens = Int8Embedding(table, model.dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each distinct storage counted once, and of
    its oneDNN-packed linear weights (``Linear.packed``, which have no storage)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    return sum(seen.values()) + sum(p.numel() * p.element_size() for p in packed)
