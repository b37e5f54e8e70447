"""Qwen3 decoder (the dense Qwen3 models, 0.6B to 32B): the Llama architecture with each head of
q and k RMS-normed before RoPE, an explicit ``head_dim`` (128, wider than ``hidden_size /
num_heads`` in the small models), and no Q/K/V biases.

Hugging Face ``modeling_qwen3.py`` differs from ``modeling_llama.py`` in those only (and in
sliding-window attention, which the released checkpoints leave off; ``models/hf_config.py``
refuses it), so the model is ``LlamaForCausalLM`` with ``LlamaConfig.qk_norm``. The fused C++ decode
op norms q and k per head as the Python layers do.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.sharding import TensorParallelShard


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Qwen3 checkpoints (HF weight names plus
    ``model.layers.N.self_attn.{q,k}_norm.weight``, ``[head_dim]``).

    Raises:
        ValueError: a config without ``qk_norm`` (every Qwen3 checkpoint has the norms).
    """

    # GGUF tensor names (after ``blk.N.``) beyond Llama's (llama.cpp's ``LLM_ARCH_QWEN3``).
    # llama.cpp stores Qwen3's Q/K rows unpermuted: its NEOX RoPE is HF's "rotate half".
    gguf_layer_names = {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        if not config.qk_norm:
            raise ValueError("Qwen3 needs qk_norm=True (q and k are RMS-normed per head)")
        super().__init__(config, dtype, quantization, tp)
