"""Request outputs, shaped as vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class CompletionOutput:
    """One sample (choice) of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: decoded text of ``token_ids`` (stop token excluded).
        token_ids: generated token ids.
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"``
            (max_tokens or max_model_len reached), ``"abort"``, or ``None`` while running.
        stop_reason: the stop token id or stop string that ended it, else ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

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
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
