"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, OLMoE): Llama's decoder layer with the MLP
replaced, in the layers the config names, by a sparse MoE block (``layers/fused_moe.py``).

The families differ in their attention (``models/qwen3_moe.py``: per-head q/k norms;
``models/mixtral.py``: plain, with an optional window; ``models/olmoe.py``: q/k norms over the
whole projection and optional clipping), in whether the top-k probabilities are renormalized
(``norm_topk_prob``; Mixtral always), and in their checkpoint names
(``MoEForCausalLM.moe_block_name``, ``expert_weight_names``).

A decode step runs every layer in the fused C++ decode op (``layers/fused_decode.py``: the
same router, top-k and experts in C++) where the attention is Llama's or Qwen3's.
Quantization (``int8``, ``int4``, ``w8a8``, ``w4a8``) quantizes every expert's two projections
like a dense layer's (the router stays float, as in vLLM; ``w8a8``'s calibration sees only the
experts its text routes to, the others get no smoothing); checkpoints quantized by other tools
are refused. Tensor parallelism is refused (see
docs/tensor-parallel.md for the split it would take).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from pagedllm.layers.fused_moe import Expert, fused_experts, route
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization import QuantizableLinear
from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.sharding import TensorParallelShard

MOE_QUANTIZATION_METHODS = (None, "int8", "int4", "w8a8", "w4a8")


@dataclass
class MoEConfig(LlamaConfig):
    """``LlamaConfig`` plus the experts (Hugging Face names).

    ``moe_layers[i]``: layer ``i`` has the MoE block (else a dense ``LlamaMLP`` of
    ``intermediate_size``: Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
    ``moe_intermediate_size``: each expert's intermediate size. ``norm_topk_prob``: the top-k
    probabilities are divided by their sum. ``clip_qkv``: q, k and v are clamped to
    ``[-clip_qkv, clip_qkv]`` (OLMoE; None: not).
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    clip_qkv: Optional[float] = None


class SparseMoeBlock(nn.Module):
    """Router (``gate``: ``[num_experts, hidden_size]``, no bias) and ``experts``; forward
    ``[num_tokens, hidden_size]`` -> same, through ``fused_experts``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.normalize)
        return fused_experts(x, self.experts, weights, expert_ids)


def gguf_expert_layer_names(block: str, expert_weight_names: tuple[str, str, str]) -> dict[str, str]:
    """GGUF tensor names (after ``blk.N.``) of a MoE layer -> Hugging Face names (after
    ``model.layers.N.``), as llama.cpp's converter writes them (gguf-py ``MODEL_TENSOR.FFN_GATE_INP``,
    ``FFN_{GATE,UP,DOWN}_EXP``): the router, and each projection of all experts stacked in one
    ``[num_experts, out_features, in_features]`` tensor, whose HF name has ``*`` where the expert's
    index goes (the loader unstacks it)."""
    gate, up, down = expert_weight_names
    return {"ffn_gate_inp.weight": f"{block}.gate.weight",
            "ffn_gate_exps.weight": f"{block}.experts.*.{gate}.weight",
            "ffn_up_exps.weight": f"{block}.experts.*.{up}.weight",
            "ffn_down_exps.weight": f"{block}.experts.*.{down}.weight"}


class MoEForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose MoE layers' ``mlp`` is a ``SparseMoeBlock``.

    Checkpoint names (HF): ``model.layers.N.{moe_block_name}.gate.weight`` and
    ``model.layers.N.{moe_block_name}.experts.E.{gate, up, down}.weight`` with the three names
    of ``expert_weight_names``.

    Raises:
        ValueError: ``tp.size > 1``; a checkpoint's quantization (AWQ, GPTQ, compressed-tensors); a config whose
            ``moe_layers`` does not cover every layer or whose top-k is not within the experts.
    """

    moe_block_name = "mlp"
    expert_weight_names = ("gate_proj", "up_proj", "down_proj")
    gguf_layer_names = gguf_expert_layer_names(moe_block_name, expert_weight_names)

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        if tp.size != 1:
            raise ValueError(f"{config.architecture} (mixture of experts) runs with tensor_parallel_size=1 only, "
                             f"got {tp.size}")
        if quantization not in MOE_QUANTIZATION_METHODS:
            raise ValueError(f"quantization={quantization!r} is not supported for mixture-of-experts models "
                             f"(supported: {', '.join(str(m) for m in MOE_QUANTIZATION_METHODS)})")
        if len(config.moe_layers) != config.num_hidden_layers:
            raise ValueError(f"moe_layers names {len(config.moe_layers)} layers, the model has "
                             f"{config.num_hidden_layers}")
        if not 0 < config.num_experts_per_tok <= config.num_experts:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be in [1, num_experts="
                             f"{config.num_experts}]")
        super().__init__(config, dtype, quantization, tp)
        for layer, is_moe in zip(self.layers, config.moe_layers):
            if is_moe:
                layer.mlp = SparseMoeBlock(config)
        self.requires_grad_(False)
        if self.fused_decode is not None:
            self.fused_decode.top_k, self.fused_decode.normalize_top_k = config.num_experts_per_tok, config.norm_topk_prob

    def _mlp_linears(self, mlp: nn.Module, prefix: str) -> list[QuantizableLinear]:
        """A MoE block's experts, each quantized as a dense MLP (the router stays float)."""
        if not isinstance(mlp, SparseMoeBlock):
            return super()._mlp_linears(mlp, prefix)
        return [QuantizableLinear(expert, attribute, [f"{prefix}mlp.experts.{e}.{attribute}.weight"])
                for e, expert in enumerate(mlp.experts) for attribute in ("gate_up_proj", "down_proj")]

    def _load_mlp(self, mlp: nn.Module, prefix: str, take: Callable, put: Callable) -> None:
        """A MoE layer's router and experts (gate and up fused per expert); a dense layer's
        ``LlamaMLP`` as Llama's."""
        if not isinstance(mlp, SparseMoeBlock):
            return super()._load_mlp(mlp, prefix, take, put)
        gate, up, down = self.expert_weight_names
        block = f"{prefix}{self.moe_block_name}."
        put(mlp.gate, "weight", take(block + "gate.weight"), block + "gate.weight")
        for e, expert in enumerate(mlp.experts):
            p = f"{block}experts.{e}."
            gate_up = torch.cat([take(p + gate + ".weight"), take(p + up + ".weight")])
            put(expert.gate_up_proj, "weight", gate_up, p + "gate_up_proj.weight")
            put(expert.down_proj, "weight", take(p + down + ".weight"), p + down + ".weight")


def moe_layers(num_layers: int, mlp_only_layers=(), decoder_sparse_step: int = 1) -> tuple[bool, ...]:
    """Which layers have the MoE block (HF ``Qwen3MoeDecoderLayer``): those not in
    ``mlp_only_layers`` whose ``index + 1`` is a multiple of ``decoder_sparse_step``."""
    return tuple(i not in set(mlp_only_layers) and (i + 1) % decoder_sparse_step == 0 for i in range(num_layers))

