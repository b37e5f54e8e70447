"""Weight-only quantization: ``int8`` (per output channel) and ``int4`` (group-wise
asymmetric, group 32), with pagedllm's C++ kernels for decode batches.

Formats (``W`` is a ``[N, K]`` weight, ``N`` output features, ``K`` input features):

- ``int8``: ``W[n, k] ~= scales[n] * q[n, k]``, ``q`` int8 in ``[-127, 127]``, ``scales`` fp32
  ``absmax(W[n]) / 127`` (symmetric, as vLLM's CPU ``int8`` weight-only path and
  ``torch.ao`` ``Int8WeightOnlyConfig``).
- ``int4``: ``W[n, k] ~= scales[n, g] * q[n, k] + mins[n, g]`` for ``g = k // 32``, ``q`` in
  ``[0, 15]``: the layout of GGUF ``Q4_1`` (llama.cpp ``ggml-quants.c``), and of each 32-wide
  sub-block of ``Q4_K`` (``scale = d * sc``, ``min = -dmin * m``), so both load without
  re-quantizing (``models/gguf_blocks.py``). Any other weight is quantized with the group's
  min/max (``quantize_int4``).

Both make the token embedding and the LM head int8 with a scale per 32-weight group (one copy
when tied): at one decode token the fp32 head was as many bytes as all the decoder layers in
int8. Per-channel int8 there was too coarse (the int4 SmolLM2 stopped answering "What is the
capital of France?" with Paris: its logits moved 2.7% against 0.3% from the int4 layers
alone); per group it is GGUF ``Q8_0``, the type SmolLM2's file stores its embedding in, so
that file's values are kept exactly.

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

from typing import Optional

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.quantization.base import (INT4_GROUP_SIZE, KERNEL_MAX_ROWS, Int4Weight, QuantMethod,
                                               check_whole_groups, quantize_int4, quantize_int8)


def int8_dequantize_torch(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 codes times fp32 ``scales`` (``[N]`` per row, or ``[N, K / 32]`` per
    32-weight group): the fp32 ``[N, K]`` weight (the C++ ``int8_dequantize``'s values)."""
    n, k = codes.shape
    if scales.dim() == 1:
        return codes.float() * scales[:, None]
    return (codes.float().view(n, -1, INT4_GROUP_SIZE) * scales[..., None]).view(n, k)


def int4_dequantize_torch(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``Int4Linear``'s ``packed`` ``[N, K / 2]`` uint8 with its ``scales`` and ``mins`` ``[N, K / 32]``:
    the fp32 ``[N, K]`` weight ``scales * q + mins`` (the C++ ``int4_dequantize``'s values)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    halves = packed.view(n, k // INT4_GROUP_SIZE, 1, INT4_GROUP_SIZE // 2)
    codes = torch.cat([halves & 0x0F, halves >> 4], dim=2).view(n, k).contiguous()
    return Int4Weight(codes, scales, mins).dequantize()


def _times_dequantized(dequantize):
    """The torch twin of a decode kernel: ``x`` (fp32 ``[M, K]``) times the fp32 weight that
    ``dequantize(*weights)`` gives, plus ``bias``."""
    def linear(x: torch.Tensor, *weights_and_bias: Optional[torch.Tensor]) -> torch.Tensor:
        *weights, bias = weights_and_bias
        y = torch.mm(x, dequantize(*weights).t())
        return y if bias is None else y + bias
    return linear


int8_dequantize = CustomOp("int8_dequantize", int8_dequantize_torch)
int4_dequantize = CustomOp("int4_dequantize", int4_dequantize_torch)
int8_linear = CustomOp("int8_linear", _times_dequantized(int8_dequantize_torch))
int4_linear = CustomOp("int4_linear", _times_dequantized(int4_dequantize_torch))


class _QuantizedLinear(nn.Module):
    """What ``Int8Linear`` and ``Int4Linear`` share: an fp32 ``bias`` (or None), the C++ kernel
    ``_op`` for decode-sized batches fed the buffers ``_weight_names``, and dequantize-then-GEMM
    for larger ones.

    ``forward(x, out_dtype=None)`` takes ``x`` ``[M, K]`` (fp32 or bf16) and returns ``[M, N]``
    in ``out_dtype`` (default: ``x``'s dtype). With an ``input_order`` (``[K]`` int64, a GPTQ
    act-order checkpoint) the weight's columns are stored sorted by group, and ``x``'s columns
    are gathered into that order first; ``decode_layers`` does not gather, so such a model
    runs its Python layers (``models/quantize.py: quantize_model`` turns ``fused_decode`` off). Up to ``KERNEL_MAX_ROWS`` rows the product is
    computed in fp32 from the exact stored weights whatever ``x``'s dtype, by the kernel or,
    without the C++ ops, by the same fp32 formulation in torch, so both paths agree to fp32
    summation order in every compute dtype. Larger batches multiply in ``x``'s dtype (a bf16
    GEMM by the weight rounded to bf16).
    """

    _op: CustomOp
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
            weights = [getattr(self, name) for name in self._weight_names]
            return self._op(x.float().contiguous(), *weights, self.bias).to(out_dtype)
        y = torch.mm(x, self.dequantize(x.dtype).t())
        return (y if self.bias is None else y + self.bias.to(x.dtype)).to(out_dtype)


class Int8Linear(_QuantizedLinear):
    """``y = x @ (scales * q).T + bias`` with int8 ``q`` ``[N, K]`` and fp32 ``scales``, ``[N]``
    per output channel or ``[N, K / 32]`` per 32-weight group (``quantize_int8``).

    """

    _op, _weight_names = int8_linear, ("codes", "scales")

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
        return int8_dequantize_torch(self.codes[index], self.scales[index]).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the layer multiplies by, in ``dtype`` (one C++ pass when built)."""
        return int8_dequantize(self.codes, self.scales).to(dtype)


class Int4Linear(_QuantizedLinear):
    """``y = x @ W.T + bias`` with ``W`` group-32 asymmetric 4-bit, ``W = scales * q + mins``.

    Holds ``packed`` (``[N, K / 2]`` uint8: in each 32-weight group, byte ``i`` has weight ``i``
    in its low nibble and weight ``i + 16`` in its high nibble, GGUF ``Q4_1``'s order) and
    ``scales``, ``mins`` (``[N, K / 32]`` fp32).
    """

    _op, _weight_names = int4_linear, ("packed", "scales", "mins")

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
        return int4_dequantize(self.packed, self.scales, self.mins).to(dtype)



def _kernel_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether the quantized kernels take ``x``: a decode-sized batch, or any batch under
    ``PAGEDLLM_BATCH_INVARIANT=1`` (the kernels compute each row alone, where a prefill's
    dequantize-and-GEMM sums in an order that depends on the row count)."""
    return (x.dim() == 2 and in_features % INT4_GROUP_SIZE == 0
            and (x.shape[0] <= KERNEL_MAX_ROWS or envs.PAGEDLLM_BATCH_INVARIANT))



def grouped_int8_vocab(lm_head: nn.Module, embedding: torch.Tensor, tied: bool) -> tuple[nn.Module, nn.Module]:
    """The LM head as a grouped ``Int8Linear`` (GGUF ``Q8_0``'s weights) and the embedding's
    table: the same layer when ``tied``, else the embedding's own grouped int8 weight."""
    head = Int8Linear.from_float(lm_head.weight, lm_head.bias, grouped=True)
    return head, head if tied else Int8Linear.from_float(embedding, None, grouped=True)


class Int8Method(QuantMethod):
    """``int8``: every decoder projection an ``Int8Linear`` (per output channel), the LM head
    and embedding grouped int8."""

    name = "int8"

    def quantize_linear(self, linear, parts, activation_absmax):
        return Int8Linear.from_float(linear.weight, linear.bias)

    def quantize_vocab(self, lm_head, embedding, tied):
        return grouped_int8_vocab(lm_head, embedding, tied)


class Int4Method(QuantMethod):
    """``int4``: every decoder projection an ``Int4Linear`` (a GGUF file's 4-bit codes when
    every fused part has them, else quantized from the float weight), the LM head and
    embedding grouped int8. Under tensor parallelism a row-parallel slice must be whole groups.

    ``layer_class``: the layer built from an ``Int4Weight`` and a bias, with ``from_float``
    (``W4A8Method`` takes the same weights into ``W4A8Linear``)."""

    name = "int4"
    loads_gguf_int4 = True
    layer_class = Int4Linear

    def quantize_linear(self, linear, parts, activation_absmax):
        if all(p is not None for p in parts.values()):
            return self.layer_class(Int4Weight.cat(list(parts.values())), linear.bias)
        return self.layer_class.from_float(linear.weight, linear.bias)

    def quantize_vocab(self, lm_head, embedding, tied):
        return grouped_int8_vocab(lm_head, embedding, tied)

    def check_tensor_parallel(self, size, column_rows, row_inputs):
        check_whole_groups(self.name, size, row_inputs)
