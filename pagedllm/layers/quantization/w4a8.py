"""``w4a8``: 4-bit weights times int8 activations quantized per token and 32-input group,
multiplied in integers (llama.cpp's ``Q4_1 x Q8_1`` dot, ``csrc/w4a8.cpp``); and the 8-bit
layout of the same kernel, ``Q8_0Linear`` (GGUF ``Q8_0`` weights), the LM head of ``w4a8`` and
``w8a8``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.ops import native_ops
from pagedllm.layers.quantization.base import INT4_GROUP_SIZE, Int4Weight, quantize_int4, quantize_int8
from pagedllm.layers.quantization.weight_only import Int4Method, grouped_int8_vocab


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


w4a8_linear = CustomOp("w4a8_linear", w4a8_linear_torch)


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
        y = w4a8_linear(x, self.blocked, self.bias)
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
        y = w4a8_linear(x, self.blocked, self.bias)
        return y if out_dtype is None else y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"



def q8_0_vocab(lm_head: nn.Module, embedding: torch.Tensor, tied: bool) -> Optional[tuple[nn.Module, nn.Module]]:
    """The LM head as a ``Q8_0Linear`` and the embedding's table (the same layer when ``tied``),
    or None when either weight does not split into whole tiles and groups."""
    if not (Q8_0Linear.fits(lm_head.weight) and Q8_0Linear.fits(embedding)):
        return None
    head = Q8_0Linear.from_float(lm_head.weight, lm_head.bias)
    return head, head if tied else Q8_0Linear.from_float(embedding, None)


class W4A8Method(Int4Method):
    """``w4a8``: ``int4``'s weights (a GGUF file's 4-bit codes when every fused part has them)
    in ``W4A8Linear`` layers, the LM head a ``Q8_0Linear`` (a grouped ``Int8Linear`` when its
    shape has no whole tiles). Under tensor parallelism each rank's slices must be whole groups
    (row-parallel inputs) and whole tiles of ``W4A8_TILE`` (column-parallel outputs)."""

    name = "w4a8"
    layer_class = W4A8Linear

    def quantize_vocab(self, lm_head, embedding, tied):
        return q8_0_vocab(lm_head, embedding, tied) or grouped_int8_vocab(lm_head, embedding, tied)

    def check_tensor_parallel(self, size, column_rows, row_inputs):
        super().check_tensor_parallel(size, column_rows, row_inputs)
        for projection, rows in column_rows.items():
            if rows % W4A8_TILE:
                raise ValueError(f"w4a8 with tensor_parallel_size={size}: {projection} has {rows} output features "
                                 f"per rank, not whole tiles of {W4A8_TILE}")
