"""``w8a8``: int8 weights times int8 activations quantized per token (SmoothQuant, Xiao et al.
2023, sections 3-4, calibrated at load: ``models/quantize.py``), multiplied by the CPU's u8 x
s8 dot product (``csrc/w8a8.cpp``). The LM head (and the embedding it is tied to) is a
``Q8_0Linear`` when its shape splits into that layout's tiles, else it stays in the compute
dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.quantization.base import QuantMethod, quantize_int8
from pagedllm.layers.quantization.w4a8 import q8_0_vocab

# SmoothQuant's migration strength. SmolLM2-135M, perplexity on 2,048 tokens of the shipped text
# (calibrated on the next 1,024): fp32 unquantized 18.50; W8A8 with alpha 0.5 19.78, 0.6 19.05,
# 0.65 18.36, 0.7 18.76, 0.8 18.61, 0.9 19.23; bf16 unquantized 18.55, W8A8 without smoothing
# 19.81, alpha 0.8 18.46. The curve is noisy; 0.8 is within 1 % in both dtypes.
W8A8_SMOOTHING_ALPHA = 0.8


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


# Input channels per fp32 product in int8_matmul_exact: 1,024 x 128 x 128 = 2 ** 24.
EXACT_FP32_CHANNELS = 1024


def int8_matmul_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of int8 matrices, exact: ``[M, K]`` x ``[N, K]`` -> ``[M, N]`` int32.

    Computed as fp32 products over runs of at most 1,024 input channels: every partial sum is
    an integer of magnitude at most 2 ** 24, so each run's product is exact in whatever order
    the GEMM adds, and the runs are added in int32. Not ``torch._int_mm``: on an AVX2-only CPU
    (no VNNI, as an AMD Zen 3) oneDNN's s8 x s8 product is not exact; with oneDNN held to AVX2
    (``ONEDNN_MAX_CPU_ISA=AVX2``, torch 2.13) it was off by up to 1.3e5 over 576 inputs.
    """
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32)
    for start in range(0, a.shape[1], EXACT_FP32_CHANNELS):
        end = start + EXACT_FP32_CHANNELS
        out += (a[:, start:end].float() @ b[:, start:end].float().t()).to(torch.int32)
    return out


def w8a8_linear_torch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, smooth_inv: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the C++ ``w8a8_linear`` (``csrc/w8a8.cpp``), bitwise equal to it.

    Each row of ``x * smooth_inv`` is quantized to int8 with its own scale (``absmax / 127``,
    round half to even), multiplied by ``codes`` exactly (``int8_matmul_exact``), and the
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
    y = int8_matmul_exact(q, codes).float() * x_scales * scales
    return (y if bias is None else y + bias).to(x.dtype)


w8a8_linear = CustomOp("w8a8_linear", w8a8_linear_torch)


class W8A8Linear(nn.Module):
    """``y ~= x @ W.T + bias`` in int8 x int8 (``quantization="w8a8"``): SmoothQuant (Xiao et al.
    2023, sections 3-4) with per-token dynamic activation scales, as vLLM's CPU W8A8 path.

    The weight is stored as ``W * s`` quantized per output channel (``quantize_int8``), where
    the smoothing factor ``s[k] = amax_x[k] ** alpha / amax_w[k] ** (1 - alpha)`` moves the
    activation outliers of input channel ``k`` into the weight; ``x`` is multiplied by
    ``smooth_inv = 1 / s`` as it is quantized. ``amax_x`` comes from a calibration pass
    (``models/quantize.py``); without one ``s`` is 1. Every batch size takes the same
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
        y = w8a8_linear(x, self.codes, self.scales, self.smooth_inv, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"



class W8A8Method(QuantMethod):
    """``w8a8``: every decoder projection a ``W8A8Linear`` smoothed by the activation ranges of
    a calibration pass. Refused under tensor parallelism: calibration runs the whole model."""

    name = "w8a8"
    needs_calibration = True

    def quantize_linear(self, linear, parts, activation_absmax):
        return W8A8Linear.from_float(linear.weight, linear.bias, activation_absmax)

    def quantize_vocab(self, lm_head, embedding, tied):
        return q8_0_vocab(lm_head, embedding, tied)

    def check_tensor_parallel(self, size, column_rows, row_inputs):
        raise ValueError(f"quantization='w8a8' with tensor_parallel_size={size} is not supported yet "
                         "(its calibration runs on the whole model); use tensor_parallel_size=1")
