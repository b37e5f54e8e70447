"""All decoder layers of a decode-only step in one C++ call: ``csrc/decoder_layer.cpp``'s
``decode_layers``.

The op runs the standard Llama decoder layer (RMSNorm, fused QKV with optional bias, RoPE,
KV write, paged decode attention, o projection, RMSNorm fused with the residual add, gate/up,
SiLU x up, down) with the same ops in the same order as the Python layers, so its results are
bitwise theirs, without ~10 Python-level calls per layer (a third of a single-stream step
before) or the Python loop over layers. Two variations run too: Qwen3's per-head q/k norms, and
a sparse MoE block in place of the MLP (Qwen3-MoE, Mixtral: router, top-k and the experts as
``layers/fused_moe.py`` runs them, ~60 Python-level calls per layer). A model whose decoder
layers have that shape owns a ``FusedDecode`` over them and asks it first in ``forward``; every
other step runs the Python layers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.custom_op import native_ops
from pagedllm.layers.quantization import INT4_GROUP_SIZE, KERNEL_MAX_ROWS, Int4Linear, Int8Linear


def layer_args(layer: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """One layer's part of ``decode_layers``'s ``weights`` and ``list_sizes``.

    ``weights``: the input and post-attention norm weights (then ``self_attn.{q_norm, k_norm}``'s
    where the layer has per-head q/k norms), the tensors of the qkv and o projections
    (``kernel_args``), then those of the MLP's lists: ``gate_up_proj`` and ``down_proj``, or for
    a ``SparseMoeBlock`` its router (``gate``) and each expert's two. ``list_sizes``: the number
    of norms, the qkv and o list lengths, the number of MLP lists and their lengths.

    ``layer`` has the standard shape: ``input_layernorm``, ``self_attn.{qkv_proj, o_proj}``,
    ``post_attention_layernorm``, ``mlp.{gate_up_proj, down_proj}`` or ``mlp.{gate, experts}``.
    """
    attn = layer.self_attn
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if attn.q_norm is not None:
        norms += [attn.q_norm.weight, attn.k_norm.weight]
    attn_lists = [attn.qkv_proj.kernel_args(), attn.o_proj.kernel_args()]
    mlp_lists = [linear.kernel_args() for linear in _mlp_linears(layer.mlp)]
    weights = norms + [t for linear in attn_lists + mlp_lists for t in linear]
    sizes = [len(norms), *(len(linear) for linear in attn_lists), len(mlp_lists), *(len(linear) for linear in mlp_lists)]
    return weights, sizes


def _mlp_linears(mlp: nn.Module) -> list[nn.Module]:
    if hasattr(mlp, "experts"):
        return [mlp.gate] + [linear for expert in mlp.experts for linear in (expert.gate_up_proj, expert.down_proj)]
    return [mlp.gate_up_proj, mlp.down_proj]


def kernels_take(layers: nn.ModuleList) -> bool:
    """Whether the C++ kernels take every projection of ``layers``: ``int8``/``int4`` layers
    need ``in_features`` in groups of 32 (their Python ``forward`` multiplies other widths by
    the dequantized weight instead; ``w8a8``/``w4a8`` refuse such layers when built)."""
    return all(linear.in_features % INT4_GROUP_SIZE == 0
               for layer in layers
               for linear in [layer.self_attn.qkv_proj, layer.self_attn.o_proj, *_mlp_linears(layer.mlp)]
               if isinstance(linear, (Int8Linear, Int4Linear)))


class FusedDecode:
    """Runs a model's standard decoder layers through ``decode_layers`` when a step allows it.

    Args:
        layers: the decoder layers (see ``layer_args``), in order.
        rotary: the model's ``RotaryEmbedding`` (``cos``/``sin`` tables).
        rms_norm_eps: the layers' RMSNorm epsilon.
        quantization: the model's method (``"int8"``, ``"int4"``, ``"w8a8"``, ...) or None.

    Attributes:
        enabled: False forces the Python layers (tests compare the two).
        top_k, normalize_top_k: the MoE blocks' routing (``SparseMoeBlock``; set by
            ``MoEForCausalLM``); 0 and False without them.
        layer_args: ``(weights, list_sizes)`` of every layer, gathered on first use; None when
            not yet, or when the layers' modules or weights were replaced since
            (``invalidate``).
    """

    def __init__(self, layers: nn.ModuleList, rotary, rms_norm_eps: float,
                 quantization: Optional[str]) -> None:
        self.layers, self.rotary, self.rms_norm_eps = layers, rotary, rms_norm_eps
        self.quantization = quantization
        self.top_k, self.normalize_top_k = 0, False
        self.enabled = True
        self.layer_args: Optional[tuple[list[torch.Tensor], list[int]]] = None
        self._kernels_take: Optional[bool] = None  # kernels_take(layers), once per gathering

    def invalidate(self) -> None:
        """Forget the gathered weights: call after replacing or re-packing any layer's modules."""
        self.layer_args = None
        self._kernels_take = None

    def applies(self, metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step can run through ``decode_layers``: the C++ ops are built, one token
        per sequence, and for weight-only quantized weights a batch and layer widths the quantized
        kernels take (``KERNEL_MAX_ROWS``, ``kernels_take``; ``w8a8`` and ``w4a8`` take any batch)."""
        if not self.enabled or metadata.prefills or metadata.num_decode_tokens != num_tokens or not num_tokens:
            return False
        if self.quantization not in (None, "w8a8", "w4a8") and num_tokens > KERNEL_MAX_ROWS:
            return False
        if self._kernels_take is None:
            self._kernels_take = kernels_take(self.layers)
        return self._kernels_take and native_ops() is not None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over the embedded decode tokens ``hidden``; returns ``(hidden, residual)``
        as the last Python layer would (the final norm is the model's). Only where ``applies``."""
        if self.layer_args is None:
            weights, list_sizes = [], []
            for layer in self.layers:
                layer_weights, layer_sizes = layer_args(layer)
                weights += layer_weights
                list_sizes += layer_sizes
            self.layer_args = (weights, list_sizes)
        attn = self.layers[0].self_attn
        return native_ops().decode_layers(
            hidden, *self.layer_args, self.rms_norm_eps, self.top_k, self.normalize_top_k, positions,
            self.rotary.cos, self.rotary.sin,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
            [key_cache for key_cache, _ in kv_caches], [value_cache for _, value_cache in kv_caches],
            metadata.slot_mapping, metadata.decode_block_tables, metadata.decode_context_lens)
