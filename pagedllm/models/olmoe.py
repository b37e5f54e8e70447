"""OLMoE decoder (OLMoE-1B-7B): Llama attention with q and k RMS-normed over the whole projection
(not per head: ``q_norm`` has ``num_heads * head_dim`` weights) and, when ``clip_qkv`` is set,
q, k and v clamped to ``[-clip_qkv, clip_qkv]`` after the norms; a sparse MoE block in every
layer (``models/moe.py``), 64 experts of ``intermediate_size``, top 8, renormalized when
``norm_topk_prob``. Hugging Face ``modeling_olmoe.py`` (``OlmoeAttention``).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.models.llama import LlamaAttention, RMSNorm
from pagedllm.models.moe import MoEConfig, MoEForCausalLM
from pagedllm.models.sharding import TensorParallelShard


class OlmoeAttention(LlamaAttention):
    """``LlamaAttention`` whose ``norm_qk_`` norms q and k across heads, then clips q, k, v."""

    def __init__(self, config: MoEConfig, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__(config, tp)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def norm_qk_(self, qkv: torch.Tensor) -> None:
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.contiguous()))
        k.copy_(self.k_norm(k.contiguous()))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)


class OlmoeForCausalLM(MoEForCausalLM):
    """``MoEForCausalLM`` with ``OlmoeAttention`` in every layer."""

    # llama.cpp's ``LLM_ARCH_OLMOE`` (rows unpermuted: NEOX RoPE); its q/k norms span all heads.
    gguf_layer_names = {"attn_q_norm.weight": "self_attn.q_norm.weight",
                        "attn_k_norm.weight": "self_attn.k_norm.weight", **MoEForCausalLM.gguf_layer_names}

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__(config, dtype, quantization, tp)
        for layer in self.layers:
            layer.self_attn = OlmoeAttention(config, tp)
        self.requires_grad_(False)
        self.fused_decode = None  # the op norms q/k per head; OLMoE norms them across heads, and clips
