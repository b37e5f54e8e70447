"""Qwen2 decoder (Qwen2, Qwen2.5, Qwen2.5-Coder): the Llama architecture with biases on the
Q/K/V projections, an LM head that may be untied, and a large RoPE theta read from the file.

Hugging Face ``modeling_qwen2.py`` differs from ``modeling_llama.py`` only in those
hyper-parameters (and sliding-window attention, which the released checkpoints leave off), so
the model is ``LlamaForCausalLM`` with Qwen2's configuration defaults.
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM
from pagedllm.models.sharding import TensorParallelShard


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Qwen2 checkpoints (same forward, same weight names).

    Raises:
        ValueError: a config without Q/K/V biases (every Qwen2 checkpoint has them).
    """

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        if not config.attention_bias:
            raise ValueError("Qwen2 needs attention_bias=True (q/k/v projections have biases)")
        super().__init__(config, dtype, quantization, tp)
