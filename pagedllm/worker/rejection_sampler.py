"""Verification of draft tokens by rejection sampling (speculative decoding).

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", section
2.3 and algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", algorithm 2; vLLM v1 ``vllm/v1/sample/rejection_sampler.py``.

A request that verifies ``k`` drafts ``d_1..d_k`` has ``k + 1`` rows of target logits: row
``j`` is the distribution ``p_j`` of the token after its last token and ``d_1..d_j``. Draft
``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection
the token is drawn from the residual ``max(0, p_j - q_j)`` (renormalized) and the rest is
dropped; if all ``k`` are accepted, a bonus token is drawn from ``p_k``. Every emitted token is
then distributed exactly as ``p`` (the papers' theorem), so the output distribution is the
target model's whatever the drafts.

The proposers here (``ngram``, ``suffix``) are deterministic: ``q_j`` is one-hot on the draft,
so the draft is accepted with probability ``p_j(d)`` and the residual is ``p_j`` without ``d``.
Greedy rows accept a draft iff it is the argmax, and end with the argmax of the first row
that disagrees: exactly the tokens non-speculative greedy decoding gives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedllm.layers.ops import argmax_logsumexp
from pagedllm.worker.sampler import SamplingMetadata, inverse_cdf_draw, process_logits, sampling_probs


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, draft_token_ids: Sequence[Sequence[int]],
                     generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """The tokens each request emits after verifying its drafts.

    Args:
        logits: ``[rows, vocab]`` target logits (any float dtype; computed in fp32): for each
            request in order, ``len(drafts) + 1`` consecutive rows.
        meta: the rows' sampling parameters (``SamplingMetadata.build`` with each request
            repeated once per row). Only parameters that do not depend on the tokens before
            a row may be set (the scheduler gives drafts to no other request).
        draft_token_ids: each request's drafts (at least one).
        generator: the engine's generator, for random requests without their own seed (a
            seeded request draws from ``meta.generators`` of its first row).

    Returns:
        Per request, the accepted drafts (a prefix of its drafts) followed by one token drawn
        from the row after them: ``num_accepted + 1`` tokens.

    Raises:
        ValueError: ``logits`` does not have one row per draft plus one per request.
    """
    num_rows = sum(len(drafts) + 1 for drafts in draft_token_ids)
    if logits.shape[0] != num_rows:
        raise ValueError(f"rejection_sample: {logits.shape[0]} logits rows for {num_rows} "
                         f"(drafts + 1 per request)")
    logits = logits.float()
    processed = process_logits(logits, meta)
    # The argmax the non-speculative sampler takes, so greedy output is the same token for token.
    argmax = argmax_logsumexp(processed)[0].tolist()
    probs = None if meta.all_greedy else sampling_probs(processed, meta)
    generators = meta.generators or {}
    greedy = meta.greedy.tolist()
    results = []
    row = 0
    for drafts in draft_token_ids:
        k = len(drafts)
        if greedy[row]:
            accepted = 0
            while accepted < k and drafts[accepted] == argmax[row + accepted]:
                accepted += 1
            results.append(list(drafts[:accepted]) + [argmax[row + accepted]])
        else:
            uniform = torch.rand(k + 1, generator=generators.get(row, generator))
            rows = probs[row:row + k + 1]
            draft_probs = rows[torch.arange(k), torch.tensor(drafts)]
            accepts = (uniform[:k] < draft_probs).tolist()
            accepted = accepts.index(False) if False in accepts else k
            final = rows[accepted]
            if accepted < k:
                residual = final.clone()
                residual[drafts[accepted]] = 0.0
                # Zero only in float rounding of a draft with p = 1, which is then always accepted.
                if residual.sum() > 0:
                    final = residual
            token = int(inverse_cdf_draw(final.unsqueeze(0), uniform[k:]).item())
            results.append(list(drafts[:accepted]) + [token])
        row += k + 1
    return results
