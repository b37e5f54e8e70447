"""Calibration for ``quantization="w8a8"`` (SmoothQuant, Xiao et al. 2023, section 4): the
largest ``|x[:, k]|`` each decoder linear layer sees on a calibration text, from one forward
pass of the float model.

The text is the part of the public-domain text shipped with pagedllm
(``pagedllm/benchmarks/data/public_domain.txt``) that ``pagedllm bench accuracy`` does not score:
its first ``ACCURACY_TOKENS`` tokens are the perplexity set, the calibration starts after them.
"""

from __future__ import annotations


import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.layers.linear import Linear

# Tokens of the shipped text that ``pagedllm bench accuracy`` scores (its default --num-tokens).
ACCURACY_TOKENS = 2048
CALIBRATION_TOKENS = 1024
_BLOCK_SIZE = 16


def calibration_token_ids(tokenizer, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """``num_tokens`` token ids to calibrate on: the shipped text after its first
    ``ACCURACY_TOKENS`` tokens, or, without a tokenizer (a model built from a checkpoint in
    memory), ids drawn from ``[0, vocab_size)`` with seed 0."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    from pagedllm.benchmarks.throughput import TEXT_PATH

    ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    return ids[ACCURACY_TOKENS:ACCURACY_TOKENS + num_tokens] if len(ids) >= ACCURACY_TOKENS + num_tokens \
        else ids[-num_tokens:]


@torch.no_grad()
def collect_input_absmax(model: nn.Module, token_ids: list[int]) -> dict[nn.Module, torch.Tensor]:
    """``{layer: [in_features] fp32}``: the largest absolute input of every ``Linear`` of the
    decoder layers over one prefill of ``token_ids`` (one sequence, a temporary KV cache).

    Raises:
        ValueError: ``token_ids`` is empty or longer than the model's positions.
    """
    if not token_ids or len(token_ids) > model.rotary.cos.shape[0]:
        raise ValueError(f"calibration needs 1 to {model.rotary.cos.shape[0]} tokens, got {len(token_ids)}")
    absmax: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, inputs: tuple) -> None:
        seen = inputs[0].detach().float().abs().amax(dim=0)
        absmax[module] = seen if module not in absmax else torch.maximum(absmax[module], seen)

    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    hooks = [m.register_forward_pre_hook(record) for m in linears]
    try:
        num_tokens = len(token_ids)
        num_blocks = -(-num_tokens // _BLOCK_SIZE)
        cache_shape = (num_blocks, _BLOCK_SIZE, model.num_kv_heads_per_rank, model.config.head_dim)
        kv_caches = [(torch.zeros(cache_shape, dtype=model.dtype), torch.zeros(cache_shape, dtype=model.dtype))
                     for _ in model.layers]
        metadata = AttentionMetadata(slot_mapping=torch.arange(num_tokens),
                                     prefills=[PrefillSequence(0, num_tokens, num_tokens, torch.arange(num_blocks))])
        model(torch.tensor(token_ids), torch.arange(num_tokens), kv_caches, metadata)
    finally:
        for hook in hooks:
            hook.remove()
    return absmax
