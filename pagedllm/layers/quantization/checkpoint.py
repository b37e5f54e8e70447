"""Checkpoints quantized by other tools (vLLM's names for the formats): ``awq`` (AutoAWQ),
``gptq`` (GPTQModel / AutoGPTQ), ``compressed-tensors`` (llm-compressor). Their integer
weights, read by ``models/quantized_checkpoint.py`` into ``Int4Weight`` / ``Int8Weight``,
replace the layers they name; a projection the checkpoint left in float (its ignore list)
stays float, and so do the embedding and LM head, as those checkpoints store them.
"""

from __future__ import annotations

from pagedllm.layers.quantization.base import Int4Weight, Int8Weight, QuantMethod
from pagedllm.layers.quantization.weight_only import Int4Linear, Int8Linear


class CheckpointMethod(QuantMethod):
    """A method whose weights come from the checkpoint (``from_checkpoint``). A fused layer
    (Q/K/V, gate/up) takes its parts only when the checkpoint quantized all of them alike; a
    GPTQ act-order weight keeps its ``input_order``. Refused under tensor parallelism:
    ``models/sharding.py`` slices plain int4 codes, not act-order or zero-point layouts yet."""

    from_checkpoint = True

    def quantize_linear(self, linear, parts, activation_absmax):
        """Raises: ValueError when only some of a fused layer's parts are quantized, or not
        all alike, or (``Int4Weight.cat``) with different input orders."""
        weights = list(parts.values())
        if all(p is None for p in weights):
            return linear
        if any(p is None for p in weights) or len({type(p) for p in weights}) > 1:
            raise ValueError(f"{list(parts)} are fused into one projection, but the checkpoint "
                             "quantizes only some of them, or not all alike")
        if isinstance(weights[0], Int8Weight):
            weight = Int8Weight.cat(weights)
            return Int8Linear(weight.codes, weight.scales, linear.bias, weight.input_order)
        return Int4Linear(Int4Weight.cat(weights), linear.bias)

    def check_tensor_parallel(self, size, column_rows, row_inputs):
        raise ValueError(f"tensor_parallel_size={size} is not supported for {self.name!r} "
                         "checkpoints yet; use tensor_parallel_size=1")


class AWQMethod(CheckpointMethod):
    name = "awq"


class GPTQMethod(CheckpointMethod):
    name = "gptq"


class CompressedTensorsMethod(CheckpointMethod):
    name = "compressed-tensors"
