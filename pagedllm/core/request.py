"""One sequence being generated: its tokens, progress and status (vLLM v1 ``Request``)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Optional, Union

from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import TokenLogprobs
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output import GrammarState

# A user's id, or ``(parent_request_id, index)`` for a sample of an ``n > 1`` request.
RequestId = Union[str, tuple[str, int]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the model forward of a step it was in raised

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """A single sequence: prompt tokens, generated tokens and how far the KV cache has them.

    The one progress counter is ``num_computed_tokens``: how many of ``all_token_ids`` have
    their K/V in the cache. Prefill, chunked prefill, decode and recompute after preemption
    are all "compute tokens ``[num_computed_tokens, num_tokens)``" (vLLM v1's design), so there
    is no phase flag to get out of sync.

    Attributes:
        request_id: unique id of this sequence: the user's string, or for a sample of an ``n > 1``
            request ``(parent_request_id, index)``, a tuple that no user id can equal.
        prompt_token_ids: prompt tokens, length >= 1.
        output_token_ids: generated tokens so far.
        max_tokens: resolved generation limit in tokens (never None here).
        seed_offset: added to ``sampling_params.seed`` for this sample's random stream (the
            sample's index in an ``n > 1`` request); the model runner keeps the stream, so a
            preempted request continues it.
        logprobs: per generated token, its raw logprob record (see ``TokenLogprobs``).
        prompt_logprobs: per prompt position, its record (``None`` at position 0); filled
            only with ``sampling_params.prompt_logprobs``.
        cumulative_logprob: sum of the raw logprobs of the generated tokens.
        cache_salt: extra prefix-cache key; requests with different salts never share blocks.
        lora_request: the LoRA adapter it runs with (None: the base model). Also a prefix-cache
            key: requests of different adapters (or one with and one without) never share blocks.
        priority: scheduling priority under the ``priority`` policy: lower runs first (vLLM's
            convention); ignored under ``fcfs``.
        num_cached_tokens: prompt tokens that were prefix-cache hits when the request was
            first scheduled (-1 before that).
        pending_forks: the other samples of an ``n > 1`` request; they are not scheduled
            themselves but fork off this request's blocks once its prompt is computed, each
            taking its first token from the same logits.
        grammar: the sequence's ``structured_outputs`` state (None: unconstrained). It has
            accepted exactly ``output_token_ids``: advanced with each appended token, untouched
            by preemption and recompute.
        spec_token_ids: draft tokens proposed to follow ``all_token_ids`` (speculative
            decoding), verified in the next step that schedules them; never part of
            ``output_token_ids`` until the model accepted them.

    Penalties read ``prompt_token_ids`` (repetition) and ``output_token_ids`` (all three)
    directly: the two lists stay apart across preemption, which only resets
    ``num_computed_tokens``.
    """

    def __init__(self, request_id: RequestId, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, eos_token_id: Optional[int], arrival_time: Optional[float] = None,
                 seed_offset: int = 0, cache_salt: Optional[str] = None, priority: int = 0,
                 lora_request: Optional[LoRARequest] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: Union[int, str, None] = None
        # Raw logprobs, collected by the engine from the model runner. They live here, beside
        # the tokens, so that a preempted request neither loses nor recomputes them twice.
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[Optional[TokenLogprobs]] = [None]
        self.cumulative_logprob = 0.0
        self.seed_offset = seed_offset
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.priority = priority
        self.num_cached_tokens = -1
        self.pending_forks: list[Request] = []
        self.grammar: Optional["GrammarState"] = None
        self.spec_token_ids: list[int] = []

    @property
    def lora_int_id(self) -> int:
        """Its adapter's ``lora_int_id``, 0 without one (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (once per request and
        step: a decode step would otherwise copy the context)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})")
