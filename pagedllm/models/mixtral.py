"""Mixtral decoder (Mixtral 8x7B, 8x22B): Mistral's attention (``sliding_window`` when the
config sets one) and a sparse MoE block in every layer (``models/moe.py``), 8 experts, top 2,
the two probabilities always renormalized (HF ``MixtralTopKRouter``). Hugging Face
``modeling_mixtral.py``; checkpoint names ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.E.{w1, w3, w2}`` (gate, up, down).
"""

from __future__ import annotations

from pagedllm.models.moe import MoEForCausalLM, gguf_expert_layer_names


class MixtralForCausalLM(MoEForCausalLM):
    """``MoEForCausalLM`` under Mixtral's checkpoint names."""

    moe_block_name = "block_sparse_moe"
    expert_weight_names = ("w1", "w3", "w2")
    # llama.cpp writes Mixtral as ``llama`` with ``llama.expert_count`` set.
    gguf_layer_names = gguf_expert_layer_names(moe_block_name, expert_weight_names)
