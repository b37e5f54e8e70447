"""Sampling parameters for one request, named and defaulted as in vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Fields mirror ``vllm.SamplingParams`` (same names, same defaults):

    - ``n``: number of independent samples (completions) for the prompt.
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens; 0 or -1 keeps all.
    - ``top_p``: keep the smallest set of tokens whose probability mass reaches ``top_p``
      (the most likely token is always kept).
    - ``seed``: per-request seed; the same seed and prompt give the same output, also after
      the request was preempted and recomputed.
    - ``max_tokens``: number of tokens to generate; ``None`` means the rest of the context
      (``max_model_len - len(prompt)``).
    - ``ignore_eos``: keep generating after the EOS token.
    - ``stop_token_ids``: extra token ids that end the request (the token is kept in
      ``token_ids`` and dropped from the text, as vLLM does).

    Raises:
        ValueError: on construction, naming the field, its value and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=0)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[]", token_id, minimum=0)
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling is an argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < _SAMPLING_EPS


_SAMPLING_EPS = 1e-5


def _check_int(name: str, value: object, minimum: Union[int, None] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
