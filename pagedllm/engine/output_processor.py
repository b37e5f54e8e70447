"""From requests' tokens to ``RequestOutput``s (vLLM v1 ``vllm/v1/engine/output_processor.py``).

Keeps, per sequence, an ``IncrementalDetokenizer`` (text and stop strings) and what was already
reported, so that ``DELTA`` outputs carry only what is new and ``FINAL_ONLY`` requests report
once. Logprob records of the model runner become ``{token_id: Logprob}`` dicts here, once each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (CompletionOutput, Logprob, PromptLogprobs, RequestOutput,
                              SampleLogprobs, TokenLogprobs)
from pagedllm.sampling_params import RequestOutputKind


@dataclass
class _SequenceState:
    detokenizer: Optional[IncrementalDetokenizer]
    logprobs: SampleLogprobs = field(default_factory=list)
    num_sent_tokens: int = 0
    sent_finished: bool = False
    prompt_logprobs: Optional[PromptLogprobs] = None
    sent_prompt_logprobs: bool = False
    first_output: int = 0  # outputs before it belong to the sequence it was forked from


class OutputProcessor:
    """Builds the outputs of the engine's requests.

    Args:
        tokenizer: the engine's tokenizer, or None (then texts are empty and logprobs carry no
            ``decoded_token``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _SequenceState] = {}

    def _state(self, request: Request) -> _SequenceState:
        state = self._states.get(request.request_id)
        if state is None:
            detokenizer = None
            if self._detokenizes(request):
                detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     request.sampling_params)
            state = self._states[request.request_id] = _SequenceState(detokenizer)
        return state

    def _detokenizes(self, request: Request) -> bool:
        """Whether the request gets text: a tokenizer, and ``SamplingParams.detokenize``."""
        return self.tokenizer is not None and request.sampling_params.detokenize

    def fork(self, request: Request) -> None:
        """Start the state of a sequence forked from another: its outputs so far are the
        other's and are not reported again; its text starts at its next token."""
        assert request.request_id not in self._states, request
        first_output = len(request.output_token_ids)
        detokenizer = None
        if self._detokenizes(request):
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.all_token_ids, request.sampling_params)
            detokenizer.num_output_tokens = first_output  # stop strings count after min_tokens
        self._states[request.request_id] = _SequenceState(detokenizer, num_sent_tokens=first_output,
                                                          first_output=first_output)

    def process_tokens(self, request: Request, new_token_ids: Sequence[int]) -> tuple[Optional[str], int]:
        """Decode the tokens the request just got (already appended to it).

        Returns:
            ``(stop, num_decoded)``: the stop string now in the text, or None (the caller
            ends the request then; the text is already cut at the match), and how many of
            ``new_token_ids`` were decoded: all of them, or up to the one that completed the
            stop string.
        """
        detokenizer = self._state(request).detokenizer
        if detokenizer is None:
            return None, len(new_token_ids)
        # Ended by an EOS or stop token (whose text is dropped), not by a complete
        # structured_outputs constraint (whose last token is part of the output).
        params, last = request.sampling_params, request.output_token_ids[-1]
        stop_terminated = (request.status == RequestStatus.FINISHED_STOPPED
                           and ((last == request.eos_token_id and not params.ignore_eos)
                                or last in params.stop_token_ids))
        num_before = detokenizer.num_output_tokens
        stop = detokenizer.update(new_token_ids, stop_terminated)
        if stop is None:
            if request.is_finished():
                detokenizer.flush()
            return None, len(new_token_ids)
        return stop, detokenizer.num_output_tokens - num_before

    def make_output(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    children: Sequence[Request], num_cached_tokens: int = 0) -> Optional[RequestOutput]:
        """The ``RequestOutput`` of a request with samples ``children``, as its output kind asks.

        ``CUMULATIVE``: every sample, everything so far. ``DELTA``: only the samples with new
        tokens or that just finished, each with what is new. ``FINAL_ONLY``: None until every
        sample finished. Also None when a ``DELTA`` request has nothing new to say.
        """
        params = children[0].sampling_params
        finished = all(child.is_finished() for child in children)
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = params.output_kind is RequestOutputKind.DELTA
        completions = []
        for index, child in enumerate(children):
            state = self._state(child)
            num_tokens = len(child.output_token_ids)
            newly_finished = child.is_finished() and not state.sent_finished
            if delta and num_tokens == state.num_sent_tokens and not newly_finished:
                continue
            if params.logprobs is not None:
                state.logprobs.extend(self._to_dicts(child.logprobs[state.first_output + len(state.logprobs):],
                                                     params.detokenize))
            start = state.num_sent_tokens if delta else state.first_output
            text = ""
            if state.detokenizer is not None:
                text = state.detokenizer.get_next_output_text(child.is_finished(), delta)
            completions.append(CompletionOutput(
                index=index,
                text=text,
                token_ids=child.output_token_ids[start:],
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
                cumulative_logprob=child.cumulative_logprob if num_tokens else None,
                logprobs=state.logprobs[start - state.first_output:] if params.logprobs is not None else None,
            ))
            state.num_sent_tokens = num_tokens
            state.sent_finished = child.is_finished()
        if not completions:
            return None
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(children[0], delta),
        )

    def _prompt_logprobs(self, first: Request, delta: bool) -> Optional[PromptLogprobs]:
        """The prompt logprobs, once all were computed (in ``DELTA`` mode only the first time).
        The first sample computes the prompt; the others fork off it."""
        if first.sampling_params.prompt_logprobs is None or len(first.prompt_logprobs) < first.num_prompt_tokens:
            return None
        state = self._state(first)
        if delta and state.sent_prompt_logprobs:
            return None
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None] + self._to_dicts(first.prompt_logprobs[1:],
                                                            first.sampling_params.detokenize)
        state.sent_prompt_logprobs = True
        return list(state.prompt_logprobs)

    def _to_dicts(self, records: Sequence[TokenLogprobs], detokenize: bool) -> list[dict[int, Logprob]]:
        """``{token_id: Logprob}`` per record: the position's own token first, then the top-k
        (a token among both keeps one entry: exactly k alternatives, plus the own token when it
        is not among them, as in vLLM). ``decoded_token`` is None when not ``detokenize``."""
        dicts = []
        for record in records:
            texts: list[Optional[str]] = [None] * len(record.token_ids)
            if self.tokenizer is not None and detokenize:
                tokens = self.tokenizer.convert_ids_to_tokens(record.token_ids)
                texts = [self.tokenizer.convert_tokens_to_string([t]) for t in tokens]
            ranks = record.ranks or [None] * len(record.token_ids)
            entry: dict[int, Logprob] = {}
            for token_id, logprob, rank, text in zip(record.token_ids, record.logprobs, ranks, texts):
                if token_id not in entry:
                    entry[token_id] = Logprob(logprob, rank, text)
            dicts.append(entry)
        return dicts

    def free(self, request_ids: Sequence[str]) -> None:
        """Forget the state of finished sequences."""
        for request_id in request_ids:
            self._states.pop(request_id, None)
