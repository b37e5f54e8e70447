"""What the model runner is told each step, as plain data (vLLM v1's ``SchedulerOutput`` with
its ``NewRequestData`` / ``CachedRequestData``: the runner never sees a live ``Request``).

The engine builds a ``ScheduledBatch`` from the scheduler's ``SchedulerOutput`` and the block
tables (``LLMEngine._make_batch``); the executor hands it to every rank's ``ModelRunner``.
Nothing here is mutated after it is built, so it could cross a process boundary as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from pagedllm.core.request import RequestId
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedllm.lora.request import LoRARequest

__all__ = ["SamplingInput", "ScheduledBatch", "ScheduledRequest"]


@dataclass(frozen=True)
class SamplingInput:
    """One sequence to sample a token for.

    Attributes:
        request_id: the sequence.
        sampling_params: its parameters.
        seed: the seed of its own random stream (``sampling_params.seed`` plus the sample's
            index for ``n > 1``), None for the runner's shared stream. The runner keeps the
            stream across steps (and preemptions) until the request finishes.
        prompt_token_ids, output_token_ids: its tokens so far, read by penalties, ``min_tokens``
            and ``bad_words`` (empty when its parameters read neither).
        eos_token_id: banned below ``min_tokens`` unless ``ignore_eos``.
        grammar_bitmask: ``[ceil(vocab / 32)]`` int32, the tokens its ``structured_outputs``
            state allows next (bit ``t % 32`` of word ``t // 32``), or None: unconstrained.
    """

    request_id: RequestId
    sampling_params: SamplingParams
    seed: Optional[int] = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_id: Optional[int] = None
    grammar_bitmask: Optional["torch.Tensor"] = None


@dataclass(frozen=True)
class ScheduledRequest:
    """One sequence's share of a step: compute positions ``[num_computed_tokens,
    num_computed_tokens + len(token_ids))``.

    Attributes:
        request_id: the sequence.
        token_ids: the tokens at those positions: the chunk of its prompt/output, or with
            drafts its last token followed by ``spec_token_ids``.
        num_computed_tokens: tokens whose K/V is in the cache already.
        block_table: physical block ids covering every position up to the last computed.
        samples: the sequences to sample from the last row: itself, then the samples of an
            ``n > 1`` request that fork off it now (each draws from the same logits); empty
            when this chunk does not reach the end of the sequence.
        spec_token_ids: the drafts it verifies (``samples`` then holds itself, which gets
            the accepted drafts and one more token).
        prompt_logprobs: ``(first_row, next_token_ids, num_top)``: rows ``first_row ...`` of
            this chunk predict the prompt tokens ``next_token_ids`` that have no record yet,
            with ``num_top`` alternatives each; None when it asked for none or all are done.
        lora_request: its adapter, None for the base model.
        num_prompt_tokens: the sequence's prompt length (positions from it on hold output
            tokens; ``PrefillSequence.num_prompt_tokens``), None when not known.
    """

    request_id: RequestId
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    samples: tuple[SamplingInput, ...] = ()
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: Optional[tuple[int, list[int], int]] = None
    lora_request: Optional["LoRARequest"] = None
    num_prompt_tokens: Optional[int] = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0


@dataclass(frozen=True)
class ScheduledBatch:
    """One step for the model runner.

    Attributes:
        requests: the sequences computed this step.
        blocks_to_copy: copy-on-write ``(src, dst)`` block ids, applied before the forward.
        lora_ids_in_use: adapters of every running request (kept loaded).
        finished_req_ids: sequences that ended since the last step: the runner drops their
            random streams.
        forked_streams: ``(parent_id, child_id)``: a child made by ``fork_request`` continues
            its parent's random stream from where it is now.
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    lora_ids_in_use: frozenset[int] = frozenset()
    finished_req_ids: frozenset = frozenset()
    forked_streams: list[tuple[RequestId, RequestId]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)
