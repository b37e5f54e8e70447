"""Mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): a router picks
``top_k`` of ``num_experts`` SwiGLU experts per token and the block returns their outputs
weighted by the router's probabilities.

``fused_experts`` is the CPU path: the step's (token, expert) pairs are sorted by expert, each
active expert multiplies all its tokens in one GEMM (its ``gate_up_proj`` then ``down_proj``,
the engine's ``Linear`` or a quantized one), and the weighted rows are scatter-added back to
their tokens (vLLM's ``fused_moe``: ``moe_align_block_size`` + grouped GEMM, here one
``torch`` call per expert). ``experts_per_token`` is the per-token loop it replaces: the
reference the tests compare it against and the baseline of ``bench/moe.py``.

Both add each token's expert outputs in ascending expert order, the order of Hugging Face's
``Qwen3MoeExperts.forward`` (``index_add_`` expert by expert), so fp32 results agree with
transformers' up to the GEMMs' own summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import Linear
from pagedllm.layers.ops import silu_and_mul


class Expert(nn.Module):
    """One SwiGLU expert: ``down(silu(gate(x)) * up(x))``, gate and up fused as in ``LlamaMLP``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as HF's ``*TopKRouter``: softmax over the experts in fp32, the ``top_k``
    largest probabilities, divided by their sum when ``normalize`` (``norm_topk_prob``; Mixtral
    always), returned in fp32.

    Args:
        router_logits: ``[num_tokens, num_experts]``.

    Returns:
        ``(weights, expert_ids)``: ``[num_tokens, top_k]`` fp32 and int64.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def fused_experts(x: torch.Tensor, experts: nn.ModuleList, weights: torch.Tensor,
                  expert_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum for every token, one GEMM pair per active expert.

    Args:
        x: ``[num_tokens, hidden_size]``, the compute dtype.
        experts: ``num_experts`` modules mapping ``[n, hidden_size]`` to ``[n, hidden_size]``.
        weights, expert_ids: ``route``'s ``[num_tokens, top_k]``.

    Returns:
        ``[num_tokens, hidden_size]`` in ``x``'s dtype.
    """
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    # Stable: a token's rows stay in the order of their experts, ascending after the sort.
    order = torch.argsort(flat_ids, stable=True)
    token_ids = order // top_k
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    rows = x[token_ids]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            out_rows[start:start + count] = expert(rows[start:start + count])
            start += count
    out_rows = out_rows * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_ids, out_rows)


def experts_per_token(x: torch.Tensor, experts: nn.ModuleList, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
    """``fused_experts``, token by token and expert by expert (``num_tokens * top_k`` one-row
    products): the reference and the benchmark baseline. Same arguments and result."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in torch.argsort(expert_ids[t]).tolist():
            expert = experts[int(expert_ids[t, j])]
            out[t] += expert(x[t:t + 1])[0] * weights[t, j].to(x.dtype)
    return out
