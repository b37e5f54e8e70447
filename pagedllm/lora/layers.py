"""Linear layers that add the LoRA of each row's adapter: rows of different adapters, and rows
of none, in one batch (the role of punica's SGMV kernels, Chen et al. 2023, "Punica:
Multi-Tenant LoRA Serving", section 4; vLLM ``vllm/lora/layers`` and ``punica_wrapper``).

The base layer multiplies the whole batch once, whatever its weights are (fp32, bf16 tiles,
int8 / int4 codes). Then, per adapter present in the step (a *group* of rows), the LoRA
term is two small matmuls: *shrink* ``x_g @ A^T`` to the rank, one matmul for every slice of a
fused projection (q/k/v share one ``A^T`` of ``r_q + r_k + r_v`` columns), then *expand* each
slice's ranks by its ``B^T`` into that slice's output columns, times its scaling, added in
place. A group whose rows are one contiguous range (the model runner orders rows by adapter)
is a view; otherwise its rows are gathered and the products scattered back (``index_add_``).
Arithmetic per slice is PEFT's ``base(x) + lora_B(lora_A(x)) * scaling``, in the compute
dtype of the activations (fp32 or bf16). In bf16, with the C++ ops, both products run the
``bf16_linear`` tiles (``layers/linear.py``), which compute each row alone, so a row's LoRA term
does not depend on how many rows of its adapter share the step (torch's bf16 matmul sums in an
order that does: 3 of 10 SmolLM2 requests of 4 adapters changed between batched and alone).
A and B are zero-padded to the tiles' 32 output channels, which adds exact zeros only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

from pagedllm.layers.custom_op import native_ops
from pagedllm.layers.linear import BF16_TILE, bf16_linear, block_bf16, block_fp32, fp32_linear
from pagedllm.lora.models import LoRAModel, module_shapes

# Fused projection (path inside a decoder layer) -> the HF modules it concatenates, in order.
FUSED_MODULES = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}

Rows = Union[slice, torch.Tensor]


@dataclass
class ExpandSlice:
    """One target module inside a fused projection's LoRA.

    Attributes:
        rank_start, rank_end: its columns of the shrunk ``[rows, r_total]`` activations.
        out_start, out_end: its output columns of the fused projection.
        b_t: ``B^T``, ``[rank, out_end - out_start]`` in the compute dtype.
        scaling: ``lora_alpha / r`` (or ``/ sqrt(r)``).
        b_blocked: ``B`` zero-padded to a multiple of 32 rows, in ``bf16_linear``'s tiles
            (``block_bf16``) or ``fp32_linear``'s (``block_fp32``), or None (then ``b_t``
            through ``torch.mm``).
    """

    rank_start: int
    rank_end: int
    out_start: int
    out_end: int
    b_t: torch.Tensor
    scaling: float
    b_blocked: Optional[torch.Tensor] = None


@dataclass
class PackedLoRA:
    """One adapter's LoRA of one fused projection, in the compute dtype.

    Attributes:
        a_t: the concatenated ``A^T`` of the targeted slices, ``[in_features, r_total]``.
        slices: the targeted slices (a module the adapter does not target has none).
        a_blocked: ``A`` zero-padded to a multiple of 32 rows in ``bf16_linear``'s or
            ``fp32_linear``'s tiles, or None: set, with every slice's ``b_blocked``, with the C++
            ops built, for fp32, and for bf16 where ``in_features`` and every rank are even
            (the bf16 tiles take input pairs).
    """

    a_t: torch.Tensor
    slices: list[ExpandSlice]
    a_blocked: Optional[torch.Tensor] = None


def _padded_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 (K even) or fp32 zero-padded to N a multiple of 32, as ``block_bf16`` or
    ``block_fp32`` tiles."""
    rows = -(-weight.shape[0] // BF16_TILE) * BF16_TILE
    padded = torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])
    return block_bf16(padded) if weight.dtype == torch.bfloat16 else block_fp32(padded)


def _tiled_product(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a weight in ``_padded_tiles`` (the padding's columns included)."""
    return bf16_linear(x, blocked, None) if blocked.dim() == 4 else fp32_linear(x, blocked, None)


def pack_adapter(lora_model: LoRAModel, config, dtype: torch.dtype) -> dict[tuple[int, str], PackedLoRA]:
    """``(layer_index, fused path)`` -> ``PackedLoRA`` of every projection the adapter targets."""
    shapes = module_shapes(config)
    packed = {}
    for layer in range(config.num_hidden_layers):
        for path, modules in FUSED_MODULES.items():
            a_parts, slices, rank, out = [], [], 0, 0
            for module in modules:
                out_size = shapes[module][1]
                weights = lora_model.loras.get((layer, module))
                if weights is not None:
                    a_parts.append(weights.lora_a)
                    slices.append(ExpandSlice(rank, rank + weights.rank, out, out + out_size,
                                              weights.lora_b.t().contiguous().to(dtype), weights.scaling))
                    rank += weights.rank
                out += out_size
            if slices:
                packed[(layer, path)] = tile_lora(PackedLoRA(torch.cat(a_parts).t().contiguous().to(dtype),
                                                                 slices))
    return packed


def tile_lora(lora: PackedLoRA) -> PackedLoRA:
    """Set ``lora``'s ``a_blocked`` and its slices' ``b_blocked`` (in place; returns it) where
    they apply: the C++ ops built, and fp32, or bf16 with ``in_features`` and every rank even.
    The tiles compute each row alone, so a request's LoRA rows do not depend on its batch."""
    pairs = lora.a_t.shape[0] % 2 == 0 and all((part.rank_end - part.rank_start) % 2 == 0 for part in lora.slices)
    if native_ops() is not None and (lora.a_t.dtype == torch.float32
                                     or lora.a_t.dtype == torch.bfloat16 and pairs):
        lora.a_blocked = _padded_tiles(lora.a_t.t())
        for part in lora.slices:
            part.b_blocked = _padded_tiles(part.b_t.t())
    return lora


def add_lora(y: torch.Tensor, x: torch.Tensor, groups: Sequence[tuple[PackedLoRA, Rows]]) -> torch.Tensor:
    """``y[rows] += scaling * (x[rows] @ A^T) @ B^T`` per group and slice, in place; returns ``y``.

    Args:
        y: ``[num_tokens, out_features]``, the base layer's output (modified).
        x: ``[num_tokens, in_features]``, its input, in ``y``'s dtype.
        groups: ``(packed, rows)``: rows as a ``slice`` (one contiguous range) or an int64
            index tensor; no row in two groups.
    """
    for packed, rows in groups:
        contiguous = isinstance(rows, slice)
        x_rows = x[rows] if contiguous else x.index_select(0, rows)
        tiles = packed.a_blocked is not None and x.dtype == packed.a_t.dtype
        if tiles:
            shrunk = _tiled_product(x_rows.contiguous(), packed.a_blocked)[:, :packed.a_t.shape[1]]
        else:
            shrunk = torch.mm(x_rows, packed.a_t)
        for part in packed.slices:
            if tiles:
                delta = _tiled_product(shrunk[:, part.rank_start:part.rank_end].contiguous(),
                                       part.b_blocked)[:, :part.out_end - part.out_start].mul_(part.scaling)
            else:
                delta = torch.mm(shrunk[:, part.rank_start:part.rank_end], part.b_t).mul_(part.scaling)
            if contiguous:
                y[rows, part.out_start:part.out_end].add_(delta)
            else:
                y[:, part.out_start:part.out_end].index_add_(0, rows, delta)
    return y


@dataclass
class LoRAContext:
    """The current step's groups, shared by every ``LoRALinear`` of one model.

    Set by ``LoRAModelManager.activate`` around one forward and emptied after it, so a step
    without adapters (or an engine without LoRA over the same model) sees no groups.

    Attributes:
        groups: ``(adapter, rows)``: the adapter's packed projections by ``(layer_index, path)``
            and the rows that run through it.
    """

    groups: list[tuple[dict[tuple[int, str], PackedLoRA], Rows]] = field(default_factory=list)


class LoRALinear(nn.Module):
    """A base projection (any of the engine's linear layers) plus the LoRA of each row's adapter.

    Args:
        base: the layer it wraps; its output is computed first, over all rows.
        layer_index, path: where it sits (``FUSED_MODULES`` key), the key of its adapters'
            ``PackedLoRA``.
        context: the model's ``LoRAContext``.
    """

    def __init__(self, base: nn.Module, layer_index: int, path: str, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.key = (layer_index, path)
        self.context = context

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base.bias

    def kernel_args(self) -> list[torch.Tensor]:
        """The base layer's (the fused C++ decode runs only steps without adapters)."""
        return self.base.kernel_args()

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        y = self.base(x, out_dtype)
        groups = [(adapter[self.key], rows) for adapter, rows in self.context.groups if self.key in adapter]
        return add_lora(y, x, groups) if groups else y


def wrap_model(model: nn.Module) -> LoRAContext:
    """Replace each decoder layer's projections by ``LoRALinear``s over them (once per model;
    a model already wrapped keeps its layers) and return the model's ``LoRAContext``."""
    if model.lora_context is not None:
        return model.lora_context
    context = LoRAContext()
    for index, layer in enumerate(model.layers):
        for path in FUSED_MODULES:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, LoRALinear(getattr(parent, name), index, path, context))
    model.lora_context = context
    if model.fused_decode is not None:
        model.fused_decode.invalidate()
    return context
