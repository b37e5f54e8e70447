"""Request outputs, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union


class TokenLogprobs(NamedTuple):
    """Raw logprobs at one position, as the model runner reports them.

    Attributes:
        token_ids: the position's actual token (sampled or prompt) first, then the top-k
            alternatives, most likely first (k may be 0).
        logprobs: their raw logprobs (natural log, finite, floored at -9999.0).
        ranks: their ranks (1 = most likely); empty when only the logprob was asked for.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class Logprob:
    """A token's logprob, as vLLM's ``Logprob``.

    Values are raw: log-softmax of the model's logits before penalties, logit bias, masks,
    temperature and top-k/top-p/min-p (vLLM's default ``logprobs_mode``), so they do not depend
    on the number of alternatives asked for nor on the sampling settings. They are finite
    (floored at -9999.0, OpenAI's value for impossible tokens), so they serialize to JSON.

    Attributes:
        logprob: natural-log probability.
        rank: 1 for the most likely token.
        decoded_token: the token's text on its own (may hold U+FFFD for a partial character).
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: {token_id: Logprob}, the position's own token first, then the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One sample (choice) of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: decoded text of ``token_ids`` (stop token excluded).
        token_ids: generated token ids.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"``
            (max_tokens or max_model_len reached), ``"abort"``, ``"error"`` (the model forward
            failed; see ``RequestOutput.error``), or ``None`` while running.
        stop_reason: the stop token id or stop string that ended it, else ``None``.
        cumulative_logprob: sum of the raw logprobs of all generated tokens so far (also in
            ``DELTA`` mode), or ``None`` before the first token.
        logprobs: one dict per token of ``token_ids`` when ``logprobs`` was asked, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at its end).

    Attributes:
        request_id: the id given to ``add_request`` (or made by ``LLM.generate``).
        prompt: the prompt text, or ``None`` when the request came as token ids.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per sample.
        finished: True once every sample has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: one entry per prompt token (``None`` for the first) when
            ``prompt_logprobs`` was asked, else None; in ``DELTA`` mode only in the first output.
        error: why the request ended with finish_reason ``"error"`` (the model forward of a
            step it was in raised), else None.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[PromptLogprobs] = None
    error: Optional[str] = None
