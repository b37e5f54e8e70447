"""Prompt-lookup drafts (vLLM v1 ``spec_decode/ngram_proposer.py``; Saxena 2023, "Prompt
Lookup Decoding"; llama.cpp's ``--lookup``)."""

from __future__ import annotations

from typing import Sequence

from pagedllm.core.request import Request


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, max_num_tokens: int) -> list[int]:
    """The tokens that followed the best earlier occurrence of the sequence's last tokens.

    Among the earlier positions whose preceding tokens match the last ``n`` tokens of
    ``token_ids`` (``min_n <= n <= max_n``), the one with the longest match wins, the latest
    one on a tie (recent text predicts best: in an edit the output copies the prompt in
    order); the draft is the up to ``max_num_tokens`` tokens after it.

    Args:
        token_ids: prompt and output tokens so far.
        min_n, max_n: shortest and longest suffix matched (tokens).
        max_num_tokens: the most tokens proposed.

    Returns:
        The draft, possibly empty (no match of ``min_n`` tokens).

    Cost: one reversed copy and a C-speed scan for the last token, then up to ``max_n``
    comparisons per occurrence of it: O(len(token_ids) + occurrences x max_n).
    """
    num_tokens = len(token_ids)
    if num_tokens < min_n + 1 or max_num_tokens < 1:
        return []
    reversed_ids = list(reversed(token_ids))  # reversed_ids[i] == token_ids[-1 - i]
    last = reversed_ids[0]
    best_length, best_end = 0, -1
    index = 0
    while best_length < max_n:
        try:
            index = reversed_ids.index(last, index + 1)
        except ValueError:
            break
        length = 1
        while length < max_n and index + length < num_tokens and reversed_ids[index + length] == reversed_ids[length]:
            length += 1
        if length > best_length:
            best_length, best_end = length, num_tokens - 1 - index
    if best_length < min_n:
        return []
    return list(token_ids[best_end + 1:best_end + 1 + max_num_tokens])


class NgramProposer:
    """``method="ngram"``: ``propose_ngram`` over each request's tokens; keeps no state.

    Args:
        prompt_lookup_min, prompt_lookup_max: the ``min_n`` / ``max_n`` of ``propose_ngram``.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Drafts to follow ``request.all_token_ids`` (at most ``max_num_tokens``)."""
        return propose_ngram(request.all_token_ids, self.min_n, self.max_n, max_num_tokens)

    def propose_batch(self, candidates: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """``propose`` for each ``(request, max_num_tokens)``, in order."""
        return [self.propose(request, max_num_tokens) for request, max_num_tokens in candidates]

    def remove(self, request_id: str) -> None:
        """Nothing to forget."""
