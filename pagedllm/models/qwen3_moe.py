"""Qwen3-MoE decoder (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm,
``models/qwen3.py``) and a sparse MoE block (``models/moe.py``) in the layers
``mlp_only_layers`` / ``decoder_sparse_step`` leave to it (all of them in the released
checkpoints), the top-k probabilities renormalized when ``norm_topk_prob`` (true in the
released checkpoints; transformers' default is false). Hugging Face
``modeling_qwen3_moe.py``; checkpoint names ``mlp.gate`` and ``mlp.experts.E.{gate,up,down}_proj``.
"""

from __future__ import annotations

from pagedllm.models.moe import MoEForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """``MoEForCausalLM`` with Qwen3's per-head q/k norms (``config.qk_norm``)."""

    # llama.cpp's ``LLM_ARCH_QWEN3MOE``: Qwen3's tensors (Q/K rows unpermuted) plus the experts.
    gguf_layer_names = {**Qwen3ForCausalLM.gguf_layer_names, **MoEForCausalLM.gguf_layer_names}
