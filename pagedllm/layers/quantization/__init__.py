"""Quantization of the linear layers: one ``QuantMethod`` per value of the ``quantization``
option, found by name in a registry (vLLM's ``vllm/model_executor/layers/quantization/``,
``get_quantization_config``).

- ``weight_only.py``: ``int8`` (per output channel) and ``int4`` (group 32, GGUF ``Q4_1``'s
  layout), with the C++ kernels of ``csrc/quant_gemm.cpp`` for decode batches;
- ``w8a8.py``: int8 weights x int8 activations per token (SmoothQuant), ``csrc/w8a8.cpp``;
- ``w4a8.py``: 4-bit weights x int8 activations per 32-input group, ``csrc/w4a8.cpp``, and
  ``Q8_0Linear``, the LM head of the two activation-quantized methods;
- ``checkpoint.py``: ``awq``, ``gptq``, ``compressed-tensors``, whose integer weights a Hugging
  Face folder holds;
- ``base.py``: the ``QuantMethod`` interface, the weights and quantizers they share.

Adding a method: a file with its ``QuantMethod`` subclass (and its layer), and one line in
``_METHODS``. Which projections a model has is the model's to say
(``quantizable_linears()``); ``models/quantize.py: quantize_model`` applies a method to them.
"""

from __future__ import annotations

from pagedllm.layers.quantization.base import (INT4_GROUP_SIZE, KERNEL_MAX_ROWS, Int4Weight, Int8Embedding,
                                               Int8Weight, QuantizableLinear, QuantMethod, quantize_int4,
                                               quantize_int8, weight_bytes)
from pagedllm.layers.quantization.checkpoint import AWQMethod, CompressedTensorsMethod, GPTQMethod
from pagedllm.layers.quantization.w4a8 import (W4A8_TILE, Q8_0Linear, W4A8Linear, W4A8Method, block_q8_0, block_w4a8,
                                               unblock_q8_0, unblock_w4a8, w4a8_linear_torch)
from pagedllm.layers.quantization.w8a8 import (W8A8_SMOOTHING_ALPHA, W8A8Linear, W8A8Method, block_w8a8, unblock_w8a8,
                                               w8a8_linear_torch)
from pagedllm.layers.quantization.weight_only import Int4Linear, Int4Method, Int8Linear, Int8Method

# The registry: the quantization option's values, in the order the CLI lists them.
_METHODS: dict[str, QuantMethod] = {method.name: method for method in (
    Int8Method(),
    Int4Method(),
    W8A8Method(),
    W4A8Method(),
    AWQMethod(),
    GPTQMethod(),
    CompressedTensorsMethod(),
)}
QUANTIZATION_METHODS = tuple(_METHODS)
CHECKPOINT_QUANTIZATION_METHODS = tuple(name for name, method in _METHODS.items() if method.from_checkpoint)


def get_quant_method(name: str) -> QuantMethod:
    """The registered method of the ``quantization`` option value ``name``.

    Raises:
        ValueError: ``name`` is not registered (it lists those that are).
    """
    method = _METHODS.get(name)
    if method is None:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {name!r}")
    return method


__all__ = [
    "CHECKPOINT_QUANTIZATION_METHODS", "INT4_GROUP_SIZE", "KERNEL_MAX_ROWS", "QUANTIZATION_METHODS", "W4A8_TILE",
    "W8A8_SMOOTHING_ALPHA", "Int4Linear", "Int4Weight", "Int8Embedding", "Int8Linear", "Int8Weight", "Q8_0Linear",
    "QuantMethod", "QuantizableLinear", "W4A8Linear", "W8A8Linear", "block_q8_0", "block_w4a8", "block_w8a8",
    "get_quant_method", "quantize_int4", "quantize_int8", "unblock_q8_0", "unblock_w4a8", "unblock_w8a8",
    "w4a8_linear_torch", "w8a8_linear_torch", "weight_bytes",
]
