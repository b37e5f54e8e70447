"""Draft proposers of speculative decoding (vLLM v1 ``vllm/v1/spec_decode/``).

A proposer reads a request's tokens (prompt and accepted output) and guesses the tokens that
follow; the model verifies the guesses in the next step (``worker/rejection_sampler.py``). The
scheduler decides who may get drafts and how many (``Scheduler.spec_decode_candidates``); the
engine asks the proposer between steps and stores the drafts on the request
(``Request.spec_token_ids``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaConfig, LlamaForCausalLM

Proposer = Union[NgramProposer, SuffixProposer, DraftModelProposer]

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig, draft_model: Optional["LlamaForCausalLM"] = None,
                  target_config: Optional["LlamaConfig"] = None, num_blocks: int = 0,
                  engine_args: Optional[EngineArgs] = None, kv_cache_dtype: Optional[torch.dtype] = None,
                  max_model_len: int = 0) -> Proposer:
    """The proposer of ``config.method`` (``config`` is checked). The other arguments are
    ``draft_model``'s (see ``DraftModelProposer``), unused by ``ngram`` and ``suffix``.

    Raises:
        ValueError: as ``DraftModelProposer``.
    """
    if config.method == "draft_model":
        return DraftModelProposer(config, draft_model, target_config, num_blocks, engine_args, kv_cache_dtype,
                                  max_model_len)
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob)
