"""Draft proposers of speculative decoding (vLLM v1 ``vllm/v1/spec_decode/``).

A proposer reads a request's tokens (prompt and accepted output) and guesses the tokens that
follow; the model verifies the guesses in the next step (``worker/rejection_sampler.py``). The
scheduler decides who may get drafts and how many (``Scheduler.spec_decode_candidates``); the
engine asks the proposer between steps and stores the drafts on the request
(``Request.spec_token_ids``).
"""

from __future__ import annotations

from typing import Union

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer

Proposer = Union[NgramProposer, SuffixProposer, DraftModelProposer]

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig) -> Union[NgramProposer, SuffixProposer]:
    """The proposer of ``config.method``: ``"ngram"`` or ``"suffix"`` (``config`` is checked).
    A ``draft_model`` proposer computes, so the worker that holds the draft model builds it
    (``Worker.initialize_cache``)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.method == "suffix", config.method
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob)
