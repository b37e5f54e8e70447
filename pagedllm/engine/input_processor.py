"""From what a user sends to what the engine queues (vLLM v1 ``InputProcessor``).

Tokenization and every admission check that needs no engine state beyond the model's fixed
facts (``ModelInfo``): prompt forms, UTF-8, the vocabulary, ``max_model_len``, ``max_tokens``,
``n`` and the pool's size. The engine, beam search and the HTTP server all go through it, so a
check and its message exist once. It holds no mutable state: any thread may use it (the server
tokenizes with it in worker threads, off the event loop).

Text is measured before it is tokenized: a text too long for ``max_model_len`` whatever the
tokenizer does is refused at once (``token_span.py``), so a huge prompt costs neither the
tokenizing time nor its memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Container, Optional, Union

from pagedllm.engine.stats import ModelInfo
from pagedllm.engine.token_span import token_span
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import CompiledGrammar
from pagedllm.utils import cdiv, check_utf8

PromptType = Union[str, dict, list]


@dataclass
class ProcessedRequest:
    """A request that passed admission (vLLM's ``EngineCoreRequest``).

    Attributes:
        request_id: the user's id.
        prompt: the prompt text, None when only token ids were given.
        prompt_token_ids: at least one, all inside the vocabulary.
        sampling_params: verified, bad words tokenized.
        max_tokens: ``sampling_params.max_tokens`` resolved (None -> what ``max_model_len``
            leaves after the prompt).
        cache_salt: prefix-cache isolation key, or None.
        arrival_time: ``time.monotonic()`` of its arrival.
        grammar: the compiled ``structured_outputs`` constraint, or None.
        lora_request: the LoRA adapter it runs with, or None.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    cache_salt: Optional[str]
    arrival_time: float
    grammar: Optional[CompiledGrammar] = None
    lora_request: Optional[LoRARequest] = None


class InputProcessor:
    """Tokenizes and validates requests against the model's fixed facts.

    Args:
        model_info: ``max_model_len``, vocabulary size, tokenizer, block size, pool size and
            ``max_num_seqs`` (``LLMEngine.get_model_info()``).
    """

    def __init__(self, model_info: ModelInfo) -> None:
        self.model_info = model_info
        self.tokenizer = model_info.tokenizer
        self.token_span = token_span(self.tokenizer)

    def process(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                in_flight: Container[str] = (), lora_request: Optional[LoRARequest] = None) -> ProcessedRequest:
        """Tokenize and check one request (see ``LLMEngine.add_request`` for the forms).

        Args:
            in_flight: the ids of unfinished requests; a duplicate is refused.
            lora_request: the adapter (checked here: its type, and that LoRA is enabled).

        Raises:
            ValueError: what ``LLMEngine.add_request`` documents.
        """
        params = params or SamplingParams()
        params.verify_vocab(self.model_info.vocab_size)
        params.tokenize_bad_words(self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer; this engine has none "
                             "(use stop_token_ids)")
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        if request_id in in_flight:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            if not self.model_info.max_loras:
                raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r}, "
                                 "but LoRA is off: start the engine with enable_lora=True (--enable-lora)")
        prompt_text, prompt_token_ids = self.tokenize(prompt, self.truncation(params))
        max_tokens = self.check_prompt(prompt_token_ids, params)
        return ProcessedRequest(request_id, prompt_text, prompt_token_ids, params, max_tokens, cache_salt,
                                time.monotonic() if arrival_time is None else arrival_time,
                                self.compile_grammar(params), lora_request)

    def compile_grammar(self, params: SamplingParams) -> Optional[CompiledGrammar]:
        """The compiled ``params.structured_outputs`` (a cache hit when the server compiled
        it already), or None.

        Raises:
            ValueError: an invalid schema, regex or grammar, or an engine without tokenizer.
        """
        if params.structured_outputs is None:
            return None
        if self.model_info.grammar_compiler is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        return self.model_info.grammar_compiler.compile(params.structured_outputs)

    def truncation(self, params: Optional[SamplingParams]) -> Optional[int]:
        """How many trailing prompt tokens ``params.truncate_prompt_tokens`` keeps, or None: all
        of them. -1 keeps what ``max_model_len`` leaves after ``max_tokens`` (after one token
        when ``max_tokens`` is None or 0), so that a prompt of any length runs."""
        keep = params.truncate_prompt_tokens if params is not None else None
        if keep != -1:
            return keep
        assert params is not None
        return max(1, self.model_info.max_model_len - max(1, params.max_tokens or 1))

    def tokenize(self, prompt: PromptType, truncate: Optional[int] = None) -> tuple[Optional[str], list[int]]:
        """``(text or None, token ids)`` of a prompt: text, a list of token ids, or a dict with
        ``prompt_token_ids`` (and optionally ``prompt``) or ``prompt``; given ``truncate``
        (``truncation``), only the last ``truncate`` ids, and a text prompt cut so becomes
        those ids' text.

        Raises:
            ValueError: another type, a dict with neither key, text too long for
                ``max_model_len`` (see ``check_text_length``; not checked when truncating),
                text that is not UTF-8, or text without a tokenizer.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])[-truncate if truncate else 0:]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)[-truncate if truncate else 0:]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        token_ids = self.encode(prompt) if truncate is None else self._encode(prompt, "prompt", False)
        if truncate and len(token_ids) > truncate:
            # The text that runs is the kept tokens' (what echo returns, as its logprobs' offsets).
            token_ids = token_ids[-truncate:]
            prompt = self.tokenizer.decode(token_ids)
        return prompt, token_ids

    def encode(self, text: str, what: str = "prompt", truncate: Optional[int] = None, **kwargs: Any) -> list[int]:
        """``text`` (a prompt) through the tokenizer (``kwargs`` go to ``encode``); given
        ``truncate``, its last ``truncate`` token ids.

        Raises:
            ValueError: text too long for ``max_model_len`` (see ``check_text_length``; not
                checked when truncating), text that is not valid UTF-8 (naming ``what``), or no
                tokenizer.
        """
        return self._encode(text, what, truncate is None, **kwargs)[-truncate if truncate else 0:]

    def _encode(self, text: str, what: str, check_length: bool, **kwargs: Any) -> list[int]:
        if check_length:
            self.check_text_length(text, what)
        check_utf8(text, what)
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompt_token_ids")
        return self.tokenizer.encode(text, **kwargs)

    def check_text_length(self, text: str, what: str = "prompt") -> None:
        """Refuse, without tokenizing, a prompt text that has more tokens than ``max_model_len``
        leaves room for, whatever the tokenizer does (``TokenSpan.min_tokens``; nothing is
        refused without a tokenizer to measure).

        Raises:
            ValueError: naming the text's length, the tokens it has at least and the limit.
        """
        if self.token_span is None:
            return
        max_model_len = self.model_info.max_model_len
        min_tokens, length = self.token_span.min_tokens(text, max_model_len - 1)
        if min_tokens + 1 > max_model_len:
            raise ValueError(f"the {what} text has {length}, so at least {min_tokens} tokens "
                             f"({self.token_span.describe()}), but max_model_len is {max_model_len}"
                             f"{self._capacity_note()} and at least one token must be generated: the "
                             f"prompt may have at most {max_model_len - 1} tokens")

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The checks of one prompt under ``params`` (its token ids, its length and the pool);
        returns its resolved ``max_tokens``. A request of several prompts checks them all
        before adding any.

        Raises:
            ValueError: see ``check_prompt_token_ids``, ``resolve_max_tokens``, ``check_num_blocks``;
                or ``min_tokens`` above the resolved ``max_tokens`` (with ``max_tokens=None``,
                what ``max_model_len`` leaves after the prompt).
        """
        try:
            self.check_prompt_token_ids(prompt_token_ids)
            max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
            if params.min_tokens > max_tokens:  # max_tokens=None: what max_model_len leaves
                raise ValueError(f"min_tokens={params.min_tokens} is more than the {max_tokens} tokens that "
                                 f"max_model_len={self.model_info.max_model_len} leaves after the "
                                 f"{len(prompt_token_ids)}-token prompt")
            self.check_num_blocks(len(prompt_token_ids), max_tokens, params.n)
        except ValueError as exc:
            if params.truncate_prompt_tokens is None:
                raise
            raise ValueError(f"truncate_prompt_tokens={params.truncate_prompt_tokens} kept {len(prompt_token_ids)} "
                             f"prompt tokens: {exc}") from None
        return max_tokens

    def check_prompt_token_ids(self, prompt_token_ids: list[int]) -> None:
        """Raises: ValueError for an empty prompt or a token id outside the vocabulary."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        vocab = self.model_info.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")

    def resolve_max_tokens(self, num_prompt: int, max_tokens: Optional[int]) -> int:
        """``max_tokens``, or what ``max_model_len`` leaves after the prompt when None.

        Raises:
            ValueError: a prompt that leaves no room for one token, or ``prompt + max_tokens``
                above ``max_model_len``.
        """
        max_model_len = self.model_info.max_model_len
        if num_prompt + 1 > max_model_len:
            raise ValueError(f"the prompt has {num_prompt} tokens, but max_model_len is {max_model_len}"
                             f"{self._capacity_note()} and at least one token must be generated: the "
                             f"prompt may have at most {max_model_len - 1} tokens")
        if max_tokens is None:
            return max_model_len - num_prompt
        if num_prompt + max_tokens > max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} tokens exceeds max_model_len={max_model_len}"
                             f"{self._capacity_note()}")
        return max_tokens

    def check_num_blocks(self, num_prompt: int, max_tokens: int, n: int) -> None:
        """The ``n`` samples run together: they must fit ``max_num_seqs`` seats and, sharing
        the prompt's full blocks, the pool.

        Raises:
            ValueError: naming the limit.
        """
        info = self.model_info
        if n > info.max_num_seqs:
            raise ValueError(f"n={n} is larger than max_num_seqs={info.max_num_seqs}: "
                             "the samples of one request must run together")
        per_sample = cdiv(num_prompt + max_tokens, info.block_size)
        shared = num_prompt // info.block_size
        needed = shared + (per_sample - shared) * n
        if needed > info.num_blocks:
            raise ValueError(f"the request needs {needed} KV blocks (n={n} samples of "
                             f"{num_prompt + max_tokens} tokens sharing {shared} prompt blocks) but "
                             f"the KV cache has {info.num_blocks} blocks of {info.block_size} tokens")

    def _capacity_note(self) -> str:
        info = self.model_info
        return (f" (the KV cache holds {info.num_blocks * info.block_size} tokens: {info.num_blocks} "
                f"blocks of {info.block_size})")
