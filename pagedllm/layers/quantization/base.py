"""What every quantization method shares: the ``QuantMethod`` interface (vLLM's
``QuantizeMethodBase`` / ``QuantizationConfig``, ``vllm/model_executor/layers/quantization/
base_config.py``), the plain 4- and 8-bit weights checkpoints and GGUF files are read into,
the quantizers, and the embedding lookup of an int8 LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import nn

INT4_GROUP_SIZE = 32
# Rows of x up to which the quantized kernels beat dequantize-then-matmul (bench/quant_matmul.py).
KERNEL_MAX_ROWS = 64
# Weights quantized per chunk of rows: fp32 temporaries of at most 16 MiB each.
QUANTIZE_CHUNK_ELEMENTS = 1 << 22


class QuantizableLinear(NamedTuple):
    """One projection a quantization method may replace (``model.quantizable_linears()``).

    Attributes:
        owner: the module holding it; attribute: its name there (``setattr(owner, attribute,
            quantized)`` installs the replacement).
        checkpoint_names: the Hugging Face weights fused into it, in order
            (``model.layers.0.self_attn.q_proj.weight``, ``...k_proj.weight``, ...): the keys
            of its pre-quantized parts.
    """

    owner: nn.Module
    attribute: str
    checkpoint_names: list[str]


class QuantMethod:
    """One value of the ``quantization`` option: how it converts a layer, what it needs at
    load, and what it refuses. Methods are stateless; ``get_quant_method(name)`` returns the
    registered instance.

    Class attributes:
        name: the option's value.
        needs_calibration: ``quantize_linear`` wants ``activation_absmax`` from a calibration
            forward of the float model (``models/quantize.py: collect_input_absmax``).
        from_checkpoint: the integer weights come from a Hugging Face folder's
            ``quantization_config`` (``models/quantized_checkpoint.py``); a layer the
            checkpoint left in float stays float.
        loads_gguf_int4: GGUF ``Q4_1``/``Q4_K`` tensors are taken as they are
            (``loader.load_prequantized_int4``) instead of quantizing their float values.
    """

    name: str
    needs_calibration = False
    from_checkpoint = False
    loads_gguf_int4 = False

    def quantize_linear(self, linear: nn.Module, parts: dict[str, Optional["Int4Weight | Int8Weight"]],
                        activation_absmax: Optional[torch.Tensor]) -> nn.Module:
        """The layer that replaces ``linear`` (a ``layers.linear.Linear`` with its float weight
        ``[N, K]`` and bias ``[N]`` or None).

        Args:
            parts: ``{checkpoint name: pre-quantized weight or None}`` for each weight fused
                into the layer, in order (``QuantizableLinear.checkpoint_names``).
            activation_absmax: ``[K]`` fp32, the largest ``|x[:, k]|`` calibration saw, or None.

        Raises:
            ValueError: a weight this method's layout cannot hold (it names the limit).
        """
        raise NotImplementedError

    def quantize_vocab(self, lm_head: nn.Module, embedding: torch.Tensor,
                       tied: bool) -> Optional[tuple[nn.Module, nn.Module]]:
        """The LM head's replacement and the table (a layer with ``rows(index, dtype)``) the
        token embedding looks rows up in, the same module when ``tied``; None keeps both.

        Args:
            lm_head: the model's float head (``weight`` ``[vocab, hidden]``, ``bias``).
            embedding: the token embedding's ``[vocab, hidden]`` float weight.
        """
        return None

    def check_tensor_parallel(self, size: int, column_rows: dict[str, int], row_inputs: dict[str, int]) -> None:
        """Whether this method's layers split over ``size > 1`` tensor-parallel ranks
        (``models/sharding.py: TensorParallelShard.check``). The default: they do.

        Args:
            column_rows: output features per rank of the column-parallel projections
                (``q_proj``, ``k_proj``, ``gate_proj``).
            row_inputs: input features of the row-parallel projections (``o_proj``,
                ``down_proj``), before the split.

        Raises:
            ValueError: naming the method, ``size`` and the projection that does not split.
        """


def check_whole_groups(name: str, size: int, row_inputs: dict[str, int]) -> None:
    """Raises: ValueError when a row-parallel projection's input slice per rank is not a whole
    number of ``INT4_GROUP_SIZE`` groups (a group's scale cannot be cut)."""
    for projection, width in row_inputs.items():
        if (width // size) % INT4_GROUP_SIZE:
            raise ValueError(f"{name} with tensor_parallel_size={size}: {projection}'s {width} input "
                             f"features split into slices of {width // size}, not whole groups of "
                             f"{INT4_GROUP_SIZE}")


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
    Rows go in chunks of at most ``QUANTIZE_CHUNK_ELEMENTS`` weights, so the fp32 temporaries
    stay small (a 151,936 x 2,048 LM head would take 1.2 GB per temporary).

    Raises:
        ValueError: ``grouped`` and ``K`` is not a multiple of 32.
    """
    n, k = weight.shape
    if grouped and k % INT4_GROUP_SIZE:
        raise ValueError(f"grouped int8 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty((n, k // INT4_GROUP_SIZE) if grouped else (n,), dtype=torch.float32)
    for start, end in _row_chunks(n, k):
        chunk = _float_rows(weight, start, end)  # rounded in place below
        if grouped:
            chunk = chunk.view(end - start, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        chunk_scales = chunk.abs().amax(dim=-1) / 127.0
        chunk_scales = torch.where(chunk_scales == 0, torch.ones_like(chunk_scales), chunk_scales)
        chunk.div_(chunk_scales[..., None]).round_().clamp_(-127, 127)
        codes[start:end] = chunk.to(torch.int8).view(end - start, k)
        scales[start:end] = chunk_scales
    return codes, scales


def _float_rows(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of ``weight`` as a new contiguous fp32 tensor, whatever ``weight``'s
    layout: a float ``Linear`` stores its weight transposed, and ``.float()`` of a transposed
    fp32 view is the view itself, of a bf16 one a transposed copy (every later op on it then
    strided: quantize_int4 took 2.2x the time within a build, Zen 4)."""
    rows = torch.empty((end - start, weight.shape[1]), dtype=torch.float32)
    rows.copy_(weight[start:end])
    return rows


def _row_chunks(n: int, k: int) -> list[tuple[int, int]]:
    rows = max(1, QUANTIZE_CHUNK_ELEMENTS // k)
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def quantize_int4(weight: torch.Tensor, half_scales: bool = False) -> Int4Weight:
    """Group-32 min/max asymmetric 4-bit (the ``Q4_1`` recipe of llama.cpp, fp32 scale and min;
    with ``half_scales`` both are rounded to fp16 before the codes are chosen, as ``Q4_1``
    stores them).

    Rows go in chunks as ``quantize_int8``'s.

    Raises:
        ValueError: ``K`` (``weight.shape[1]``) is not a multiple of 32.
    """
    n, k = weight.shape
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // INT4_GROUP_SIZE, dtype=torch.float32)
    mins = torch.empty_like(scales)
    for start, end in _row_chunks(n, k):
        # In place on one fp32 copy, amin and amax apart and the codes cast through int8:
        # aminmax over a 32-wide last dimension and a float -> uint8 cast each take ~10x the
        # time of the other ops (torch 2.13, Zen 4); the same codes, scales and mins.
        groups = _float_rows(weight, start, end).view(end - start, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        step = (high - low) / 15.0
        if half_scales:
            low, step = low.half().float(), step.half().float()
        inverse = torch.where(step == 0, torch.zeros_like(step), 1.0 / step)
        groups.sub_(low[..., None]).mul_(inverse[..., None]).round_().clamp_(0, 15)
        codes[start:end] = groups.to(torch.int8).view(torch.uint8).view(end - start, k)
        scales[start:end], mins[start:end] = step, low
    return Int4Weight(codes, scales, mins)



class Int8Embedding(nn.Module):
    """A token embedding that looks up rows of a grouped ``Int8Linear`` or a ``Q8_0Linear`` (the
    LM head's, when the two are tied, so one int8 copy serves both). ``forward``: ``[T]`` int64
    ids -> ``[T, hidden]`` in ``dtype``."""

    def __init__(self, table: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids, self.dtype)



def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each distinct storage counted once, and of
    its oneDNN-packed linear weights (``Linear.packed``, mkldnn tensors with no storage; an
    ``Int4Linear``'s ``packed`` codes are a buffer, counted once with the others)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    packed = [m.packed for m in model.modules()
              if isinstance(getattr(m, "packed", None), torch.Tensor) and m.packed.is_mkldnn]
    return sum(seen.values()) + sum(p.numel() * p.element_size() for p in packed)
