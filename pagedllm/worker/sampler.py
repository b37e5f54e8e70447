"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All rows of a step are processed with tensor ops; the only per-row Python work is building the
parameter tensors and drawing noise for rows that carry their own seeded generator.
Sampling uses the exponential race (Gumbel-max equivalent, as vLLM's ``TopKTopPSampler``):
``argmax(p / E)`` with ``E ~ Exp(1)`` draws from ``p``; a per-request ``torch.Generator``
makes the draw reproducible and unaffected by other requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors.

    Attributes:
        temperature: ``[rows]`` fp32; rows with ``greedy`` True are ignored.
        top_k: ``[rows]`` int64; ``vocab_size`` means no cut.
        top_p: ``[rows]`` fp32 in (0, 1].
        greedy: ``[rows]`` bool.
        generators: a ``torch.Generator`` or None per row.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[Optional[torch.Generator]]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
              vocab_size: int) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            generators=list(generators),
            all_greedy=all(greedy),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k set and top-p nucleus.

    Args:
        logits: ``[rows, vocab]`` fp32 (temperature already applied).
        top_k: ``[rows]`` int64 in [1, vocab] or None.
        top_p: ``[rows]`` fp32 in (0, 1] or None. The most likely token is always kept, so a
            tiny ``top_p`` degenerates to greedy instead of an empty set.

    Returns:
        The masked logits (a new tensor).
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(vocab).unsqueeze(0)
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Mass strictly before each token; drop tokens whose preceding mass already reaches p.
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
        remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[rows, vocab]`` fp32.
        batch: the rows' parameters.
        generator: the engine's global generator, for rows without their own seed.

    Returns:
        ``[rows]`` int64 token ids.
    """
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.any_top_k or batch.any_top_p:
        logits = apply_top_k_top_p(logits, batch.top_k if batch.any_top_k else None,
                                   batch.top_p if batch.any_top_p else None)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    noise.exponential_(generator=generator)
    for row, row_generator in enumerate(batch.generators):
        if row_generator is not None:
            noise[row].exponential_(generator=row_generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_ids, sampled)
