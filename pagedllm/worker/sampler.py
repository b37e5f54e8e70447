"""Batched token sampling and logprobs (vLLM v1 ``vllm/v1/sample/sampler.py``).

One step's rows go through, as tensor ops over ``[rows, vocab]``:

1. raw logprobs (``log_softmax`` of the model's logits) for ``logprobs`` and
   ``cumulative_logprob``: vLLM's default ``logprobs_mode="raw_logprobs"``;
2. token masks: ``structured_outputs`` (every constrained row's grammar bitmask in one masked
   fill, ``structured_output.apply_token_bitmask``), ``allowed_token_ids``, ``bad_words``,
   EOS/stop tokens before ``min_tokens``;
3. ``logit_bias``;
4. repetition, frequency and presence penalties (``vllm/model_executor/layers/utils.py``
   ``apply_penalties``);
5. greedy rows take the argmax here; the others: temperature, min-p, top-k/top-p, then an
   inverse-CDF draw: one uniform number per row, looked up in the row's cumulative
   distribution. (vLLM's ``TopKTopPSampler`` races exponentials instead, one random number
   per vocabulary entry: on a CPU that costs more than the softmax.) A row with a seed draws
   its number from its own ``torch.Generator``, so its samples do not depend on what else
   runs in the batch, and a preempted request continues the same stream.

The only per-row Python work is gathering each row's parameters and token lists into index
tensors; nothing loops over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedllm.core.scheduled_batch import SamplingInput
from pagedllm.layers.ops import argmax_logsumexp
from pagedllm.structured_output import apply_token_bitmask

# Floor of reported logprobs: a finite number JSON can carry (OpenAI's convention for -inf).
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step, as tensors.

    Attributes:
        temperature: ``[rows]`` fp32; 1.0 on greedy rows (ignored there).
        greedy: ``[rows]`` bool.
        all_greedy: every row is greedy (skip the random path).
        top_k: ``[rows]`` int64 in ``[1, vocab]`` or None when no row cuts.
        top_p: ``[rows]`` fp32 in (0, 1] or None.
        min_p: ``[rows]`` fp32 in [0, 1] or None.
        generators: row -> the row's seeded ``torch.Generator`` (random rows only).
        presence_penalties, frequency_penalties, repetition_penalties: ``[rows]`` fp32, or
            None when no row has a penalty.
        prompt_token_ids: ``[rows, max_prompt_len]`` int64, padded with ``vocab_size``
            (only built with penalties).
        output_token_ids: ``[rows, max_output_len]`` int64, padded with ``vocab_size``.
        banned: ``(row_index, token_index)`` int64 pairs set to -inf (bad words, EOS and stop
            tokens before ``min_tokens``), or None.
        allowed: ``(row_index, token_index)`` of ``allowed_token_ids``, and the ``[rows]`` bool
            of rows that restrict; or None.
        logit_bias: ``(row_index, token_index, bias)``, or None.
        max_num_logprobs: largest ``logprobs`` k of the rows, None when no row asks.
        grammar_bitmask: ``(rows [n] int64, bitmask [n, ceil(vocab / 32)] int32)``: the next
            tokens each constrained row's ``structured_outputs`` state allows, or None.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    generators: Optional[dict[int, torch.Generator]] = None
    presence_penalties: Optional[torch.Tensor] = None
    frequency_penalties: Optional[torch.Tensor] = None
    repetition_penalties: Optional[torch.Tensor] = None
    prompt_token_ids: Optional[torch.Tensor] = None
    output_token_ids: Optional[torch.Tensor] = None
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    allowed: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    max_num_logprobs: Optional[int] = None
    grammar_bitmask: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(cls, requests: Sequence[SamplingInput], vocab_size: int,
              generators: Optional[dict] = None) -> "SamplingMetadata":
        """Gather the rows' parameters, token histories and grammar masks (one row per
        sequence, in order); ``generators``: request_id -> the seeded stream it draws from.

        Repetition penalty counts prompt and generated tokens, presence/frequency only the
        generated ones; both lists come from the request, which keeps them apart across
        preemption and recompute.
        """
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        meta = cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            all_greedy=all(greedy),
        )
        if not meta.all_greedy:
            top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            if any(k < vocab_size for k in top_k):
                meta.top_k = torch.tensor(top_k, dtype=torch.int64)
            if any(p.top_p < 1.0 for p in params):
                meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0.0 for p in params):
                meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
            generators = generators or {}
            meta.generators = {row: generators[r.request_id] for row, r in enumerate(requests)
                               if r.request_id in generators and not greedy[row]}
        if any(p.needs_penalties for p in params):
            meta.presence_penalties = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
            meta.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
            meta.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            meta.prompt_token_ids = _pad([r.prompt_token_ids if p.needs_penalties else []
                                          for r, p in zip(requests, params)], vocab_size)
            meta.output_token_ids = _pad([r.output_token_ids if p.needs_penalties else []
                                          for r, p in zip(requests, params)], vocab_size)

        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        allowed_rows: list[int] = []
        allowed_tokens: list[int] = []
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        for row, (request, p) in enumerate(zip(requests, params)):
            banned = []
            if len(request.output_token_ids) < p.min_tokens:
                banned.extend(p.stop_token_ids)
                if not p.ignore_eos and request.eos_token_id is not None:
                    banned.append(request.eos_token_id)
            for word in p._bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or request.output_token_ids[-len(prefix):] == prefix:
                    banned.append(word[-1])
            banned_rows.extend([row] * len(banned))
            banned_tokens.extend(banned)
            if p.allowed_token_ids:
                allowed_rows.extend([row] * len(p.allowed_token_ids))
                allowed_tokens.extend(p.allowed_token_ids)
            if p.logit_bias:
                bias_rows.extend([row] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias)
                bias_values.extend(p.logit_bias.values())
        if banned_rows:
            meta.banned = (torch.tensor(banned_rows), torch.tensor(banned_tokens))
        if allowed_rows:
            restricts = torch.zeros(len(requests), dtype=torch.bool)
            restricts[allowed_rows] = True
            meta.allowed = (torch.tensor(allowed_rows), torch.tensor(allowed_tokens), restricts)
        if bias_rows:
            meta.logit_bias = (torch.tensor(bias_rows), torch.tensor(bias_tokens),
                               torch.tensor(bias_values, dtype=torch.float32))
        constrained = [row for row, request in enumerate(requests) if request.grammar_bitmask is not None]
        if constrained:
            meta.grammar_bitmask = (torch.tensor(constrained),
                                    torch.stack([requests[row].grammar_bitmask for row in constrained]))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        return meta


@dataclass
class SamplerOutput:
    """The step's picks.

    Attributes:
        sampled_token_ids: ``[rows]`` int64.
        sampled_logprobs: ``[rows]`` fp32 raw logprob of each sampled token (for
            ``cumulative_logprob``), floored at ``LOGPROB_FLOOR``.
        sampled_ranks: ``[rows]`` int64 rank of the sampled token in the raw distribution
            (1 = most likely), or None when no row asked for logprobs.
        top_token_ids: ``[rows, max_num_logprobs]`` int64, most likely first, or None.
        top_logprobs: ``[rows, max_num_logprobs]`` fp32 raw logprobs of those, or None.
    """

    sampled_token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: Optional[torch.Tensor] = None
    top_token_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` logits -> ``[rows, vocab]`` fp32 log-softmax, floored at
    ``LOGPROB_FLOOR`` so that no -inf or NaN reaches JSON."""
    return torch.nan_to_num(logits.float().log_softmax(dim=-1), nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's logprob and rank of ``token_ids``, and its ``num_top`` best tokens.

    Args:
        logprobs: ``[rows, vocab]`` fp32 (from ``compute_logprobs``).
        token_ids: ``[rows]`` int64, the token whose value is reported.
        num_top: k of the top-k (0 allowed).

    Returns:
        ``(token_logprobs [rows] fp32, ranks [rows] int64, top_ids [rows, k] int64,
        top_logprobs [rows, k] fp32)``; rank = 1 + number of tokens strictly more likely, as
        vLLM's ``batched_count_greater_than``.
    """
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return token_logprobs, ranks, top_ids, top_logprobs


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor, output_token_ids: torch.Tensor,
                    presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                    repetition_penalties: torch.Tensor) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place (vLLM ``apply_penalties``).

    Args:
        logits: ``[rows, vocab]`` fp32, modified in place.
        prompt_token_ids, output_token_ids: ``[rows, len]`` int64 padded with ``vocab``.
        presence_penalties, frequency_penalties, repetition_penalties: ``[rows]`` fp32.

    Returns:
        ``logits``. A token seen in the prompt or the output has its logit divided by the
        repetition penalty when positive, multiplied when not (CTRL, Keskar et al. 2019); then
        ``frequency * count_in_output + presence * (count_in_output > 0)`` is subtracted.
    """
    rows, vocab = logits.shape
    output_counts = _bin_counts(output_token_ids, rows, vocab)
    output_mask = output_counts > 0
    seen = torch.zeros((rows, vocab + 1), dtype=torch.bool).scatter_(1, prompt_token_ids, True)[:, :vocab]
    seen |= output_mask
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalties.unsqueeze(1) * output_counts + presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability
    (Nguyen et al. 2024, "Min P Sampling"; vLLM ``MinPLogitsProcessor``).

    Args: ``logits`` ``[rows, vocab]`` fp32 (temperature applied), ``min_p`` ``[rows]`` fp32.
    Returns: a new tensor; the top token always survives.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k set and top-p nucleus
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", s3.1); top-p is
    taken over the top-k set, renormalized (vLLM's order).

    A full sort of the vocabulary costs milliseconds per row on a CPU, so only the best
    ``TOP_P_CANDIDATES`` (or max top-k) tokens are sorted, with ``topk``; a row whose nucleus
    does not end inside them (a flat distribution) falls back to the full sort. Both give the
    same mask.

    Args:
        logits: ``[rows, vocab]`` fp32 (temperature already applied).
        top_k: ``[rows]`` int64 in [1, vocab] or None.
        top_p: ``[rows]`` fp32 in (0, 1] or None. The most likely token is always kept, so a
            tiny ``top_p`` degenerates to greedy instead of an empty set.

    Returns:
        The masked logits (a new tensor).
    """
    rows, vocab = logits.shape
    width = vocab if top_k is None else int(top_k.max())
    if top_p is not None:
        width = min(width, TOP_P_CANDIDATES)
    if width >= vocab:
        return _top_k_top_p_by_sort(logits, top_k, top_p)
    values, indices = logits.topk(width, dim=-1)
    remove = torch.zeros_like(values, dtype=torch.bool)
    exact = torch.ones(rows, dtype=torch.bool)
    if top_k is not None:
        remove |= torch.arange(width).unsqueeze(0) >= top_k.unsqueeze(1)
    if top_p is not None:
        kept = values.masked_fill(remove, float("-inf"))
        k_fits = top_k <= width if top_k is not None else torch.zeros(rows, dtype=torch.bool)
        no_cut = top_k >= vocab if top_k is not None else torch.ones(rows, dtype=torch.bool)
        # The nucleus is renormalized over the top-k set when it fits the window, else over
        # the whole vocabulary (exact only for rows without a k cut).
        log_norm = torch.where(k_fits, kept.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        probs = (kept - log_norm.unsqueeze(1)).exp()
        cumulative = probs.cumsum(dim=-1)
        remove |= (cumulative - probs) >= top_p.unsqueeze(1)
        remove[:, 0] = False
        exact = k_fits | (no_cut & (cumulative[:, -1] >= top_p))
    masked = torch.full_like(logits, float("-inf"))
    masked.scatter_(1, indices, values.masked_fill(remove, float("-inf")))
    if not bool(exact.all()):
        slow = ~exact
        masked[slow] = _top_k_top_p_by_sort(logits[slow], top_k[slow] if top_k is not None else None,
                                            top_p[slow])
    return masked


# Tokens sorted by the fast top-p path; enough for the nucleus of any peaked distribution.
TOP_P_CANDIDATES = 256


def _top_k_top_p_by_sort(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                         top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """``apply_top_k_top_p`` by a full sort of each row."""
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


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Masks, logit bias and penalties (steps 2-4 of the module docstring); a new tensor, or
    ``logits`` itself when no row asks for any.

    A row whose every token got masked (for instance ``allowed_token_ids`` holding only the
    EOS before ``min_tokens``) keeps its unmasked logits rather than turning into NaN.
    """
    processed = logits
    if (meta.allowed is not None or meta.banned is not None or meta.logit_bias is not None
            or meta.grammar_bitmask is not None):
        processed = logits.clone()
    if meta.grammar_bitmask is not None:
        apply_token_bitmask(processed, *meta.grammar_bitmask)
    if meta.allowed is not None:
        rows, tokens, restricts = meta.allowed
        keep = ~restricts.unsqueeze(1).expand_as(processed).clone()
        keep[rows, tokens] = True
        processed.masked_fill_(~keep, float("-inf"))
    if meta.banned is not None:
        processed[meta.banned] = float("-inf")
    if meta.logit_bias is not None:
        rows, tokens, bias = meta.logit_bias
        processed.index_put_((rows, tokens), bias, accumulate=True)
    if meta.repetition_penalties is not None:
        processed = apply_penalties(processed, meta.prompt_token_ids, meta.output_token_ids,
                                    meta.presence_penalties, meta.frequency_penalties,
                                    meta.repetition_penalties)
    if meta.allowed is not None or meta.banned is not None or meta.grammar_bitmask is not None:
        dead = torch.isneginf(processed).all(dim=-1)
        if dead.any():
            processed[dead] = logits[dead]
    return processed


def sampling_probs(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from (step 5 of the module docstring): temperature,
    min-p, top-k/top-p, softmax.

    Args:
        processed: ``[rows, vocab]`` fp32 logits after ``process_logits``.
        meta: the rows' parameters (``temperature`` is 1.0 on greedy rows).

    Returns:
        ``[rows, vocab]`` fp32 probabilities, 0 outside each row's kept set.
    """
    scaled = processed / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    return scaled.softmax(dim=-1)


def inverse_cdf_draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[rows, vocab]`` (need not sum to 1) for ``uniform``
    ``[rows]`` in [0, 1): the first token whose cumulative mass exceeds ``uniform x total``.
    Returns ``[rows]`` int64."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    # Strictly below the total mass, so that the draw never runs past the last token kept.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def sample(logits: torch.Tensor, meta: SamplingMetadata,
           generator: Optional[torch.Generator] = None) -> SamplerOutput:
    """Pick one token per row and report its raw logprob (and top-k when asked).

    Args:
        logits: ``[rows, vocab]`` model logits (any float dtype; computed in fp32).
        meta: the rows' parameters.
        generator: the engine's global generator, for random rows without their own seed.

    Returns:
        A ``SamplerOutput``.
    """
    logits = logits.float()
    processed = process_logits(logits, meta)
    # One C++ pass for the argmax and, when nothing changed the logits, the logsumexp.
    token_ids, processed_log_norm = argmax_logsumexp(processed)
    log_norm = processed_log_norm if processed is logits else None
    if not meta.all_greedy:
        uniform = torch.rand(processed.shape[0], generator=generator)
        for row, row_generator in (meta.generators or {}).items():
            uniform[row] = torch.rand((), generator=row_generator)
        sampled = inverse_cdf_draw(sampling_probs(processed, meta), uniform)
        token_ids = torch.where(meta.greedy, token_ids, sampled)
    if meta.max_num_logprobs is None:
        # One pass over the vocabulary instead of a full log-softmax: only cumulative_logprob
        # needs it.
        if log_norm is None:
            log_norm = logits.logsumexp(dim=-1)
        token_logprobs = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_norm
        return SamplerOutput(token_ids, torch.nan_to_num(token_logprobs, nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR))
    token_logprobs, ranks, top_ids, top_logprobs = gather_logprobs(compute_logprobs(logits), token_ids,
                                                                   meta.max_num_logprobs)
    return SamplerOutput(token_ids, token_logprobs, ranks, top_ids, top_logprobs)


def _bin_counts(token_ids: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """``[rows, len]`` ids padded with ``vocab`` -> ``[rows, vocab]`` fp32 occurrence counts."""
    counts = torch.zeros((rows, vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, token_ids, torch.ones(token_ids.shape, dtype=torch.float32))
    return counts[:, :vocab]


def _pad(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64).reshape(len(lists), width)
