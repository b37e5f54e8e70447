"""Sampling parameters for one request, named, defaulted and validated as vLLM's ``SamplingParams``."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Below this temperature sampling is an argmax (vLLM's ``_SAMPLING_EPS``).
_SAMPLING_EPS = 1e-5
# Most alternatives per token for ``logprobs``/``prompt_logprobs`` (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a running request carries (vLLM ``RequestOutputKind``).

    - ``CUMULATIVE``: everything generated so far (text, token ids, logprobs).
    - ``DELTA``: only what is new since the previous output; the concatenation of the deltas is
      the final cumulative output.
    - ``FINAL_ONLY``: nothing until the request finishes, then the whole result.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM ``StructuredOutputsParams``, same field names).

    Exactly one of:

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value that
      validates against it.
    - ``regex``: the output matches the regular expression in full (Rust ``regex`` syntax, as
      llguidance reads it: no look-around, no back-references).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar in Lark syntax (llguidance's), or GBNF (llama.cpp's
      ``::=`` rules), which is converted to Lark.
    - ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    and optionally ``disable_any_whitespace=True``: JSON without whitespace between tokens
    (by default any JSON whitespace is allowed, as in vLLM; a weak model may then fill
    ``max_tokens`` with it).

    Only the Python types and the one-kind rule are checked here; whether a schema, regex or
    grammar compiles is checked by ``GrammarCompiler.compile`` when the request is added
    (a ``ValueError`` naming the problem).

    Raises:
        ValueError: none or several kinds given, or a field of the wrong type (an empty
            ``choice``, a ``json`` string that is not JSON, a schema that is not an object).
    """

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got "
                                 f"{self.choice!r}")
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise ValueError(f"structured_outputs.choice entries must be non-empty strings, got "
                                     f"{option!r}")
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be True or False, got {value!r}")

    @property
    def kind(self) -> str:
        """``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, spec)``, the spec as canonical text: equal constraints have equal keys."""
        kind = self.kind
        spec: Any = True if kind == "json_object" else getattr(self, kind)
        spec = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += "/compact"
        return kind, spec


# vLLM's name for it before v0.10.2 (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``).
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick and report the tokens of one request.

    Fields mirror ``vllm.SamplingParams`` (same names, same defaults, same meaning):

    - ``n``: number of independent samples (completions) of the prompt, >= 1.
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2]: subtracted from the logit of each
      token once if it occurs in the *generated* tokens / once per occurrence there (OpenAI).
    - ``repetition_penalty`` > 0: divides positive logits and multiplies negative ones of every
      token present in the prompt *or* the generated tokens (CTRL paper, Keskar et al. 2019, s4.1).
    - ``temperature`` >= 0: 0 (below 1e-5) is greedy; otherwise logits are divided by it.
    - ``top_p`` in (0, 1]: keep the smallest set of most likely tokens whose mass reaches top_p
      (the most likely token is always kept, so a tiny top_p is greedy).
    - ``top_k``: keep the k most likely tokens; 0 or -1 keeps all.
    - ``min_p`` in [0, 1]: drop tokens whose probability is below ``min_p`` times the top one's.
    - ``seed``: per-request seed; same seed and prompt give the same output, also after the
      request was preempted and recomputed, whatever else runs in the batch.
    - ``stop``: strings that end the request when they appear in the decoded text (also inside
      one token or across tokens); the text is cut before the match unless
      ``include_stop_str_in_output``.
    - ``stop_token_ids``: token ids that end the request (the token stays in ``token_ids``; its
      text is dropped unless ``include_stop_str_in_output``).
    - ``ignore_eos``: keep generating after the EOS token.
    - ``max_tokens``: most tokens to generate; ``None`` means the rest of the context
      (``max_model_len - len(prompt)``). 0 is accepted (vLLM asks for >= 1): the request returns
      its prompt (and ``prompt_logprobs`` when asked) and no token, which is what ``echo`` needs.
    - ``min_tokens``: EOS and ``stop_token_ids`` are masked and stop strings ignored until this
      many tokens were generated.
    - ``logprobs``: per generated token, its logprob and the ``logprobs`` most likely
      alternatives (0 = only the sampled token's); at most ``MAX_LOGPROBS``.
    - ``prompt_logprobs``: the same for every prompt token but the first.
    - ``detokenize``: False leaves the output text empty (``""``) and the logprobs'
      ``decoded_token`` None: token ids only, as vLLM; stop strings then need text and are
      refused.
    - ``skip_special_tokens``: leave special tokens out of the text.
    - ``spaces_between_special_tokens``: passed to the tokenizer's decoding; Hugging Face fast
      tokenizers (the only kind pagedllm loads) decode the same either way, as in vLLM.
    - ``logit_bias``: ``{token_id: bias}`` added to the logits before sampling (OpenAI);
      string keys holding integers are accepted, as JSON bodies carry them.
    - ``allowed_token_ids``: when given, only these tokens can be sampled.
    - ``bad_words``: words that are never generated: the last token of each of their
      tokenizations is masked when the tokens before it were just generated.
    - ``output_kind``: see ``RequestOutputKind``.
    - ``structured_outputs``: a ``StructuredOutputsParams`` (or a dict of its fields): the
      output follows a JSON schema, regex, choice or grammar; the request ends (``"stop"``)
      when the constraint is complete, or at ``max_tokens`` (``"length"``) with what was
      generated. ``guided_decoding`` is vLLM's older name for the same field.
    - ``truncate_prompt_tokens``: keep only the last k tokens of the prompt, as vLLM; -1: as
      many as ``max_model_len`` leaves after ``max_tokens`` (after one token when it is None).
      The prompt text may then be longer than ``max_model_len``.

    Logprobs are *raw*: log-softmax of the model's logits before penalties, bias, masks,
    temperature or top-k/top-p/min-p (vLLM's default ``logprobs_mode="raw_logprobs"``), so a
    token's value never depends on k or on the sampling settings.

    Raises:
        ValueError: on construction, naming the field, its value and the allowed range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: Optional[list[str]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = None
    truncate_prompt_tokens: Optional[int] = None
    # Token ids of ``bad_words``, filled by the engine with its tokenizer.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        self.stop = self._verify_stop(self.stop)
        self.stop_token_ids = _check_token_list("stop_token_ids", self.stop_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            for word in self.bad_words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words entries must be non-blank strings, got {word!r}")
            self.bad_words = list(self.bad_words)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1 or -1 (what max_model_len leaves after max_tokens), "
                                 "got 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value == -1:  # vLLM's "the whole vocabulary", refused there too under max_logprobs=20
                raise ValueError(f"{name}=-1 asks for the whole vocabulary, more than the {MAX_LOGPROBS} "
                                 f"alternatives per token allowed (vLLM's max_logprobs); ask for 0 to {MAX_LOGPROBS}")
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings need the output text: stop={self.stop!r} with detokenize=False "
                             "(use stop_token_ids, or detokenize=True)")
        self.logit_bias = self._verify_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{self.structured_outputs!r}")
        if self.structured_outputs is not None and self.allowed_token_ids is not None:
            # Two whitelists: where they do not meet nothing valid can be sampled, and the
            # grammar already decides which tokens may come.
            raise ValueError("allowed_token_ids cannot be combined with structured_outputs: the "
                             "constraint already decides which tokens may be sampled")

    @staticmethod
    def _verify_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for string in stop:
            if not isinstance(string, str) or not string:
                raise ValueError(f"stop entries must be non-empty strings, got {string!r}")
        return list(stop)

    @staticmethod
    def _verify_logit_bias(logit_bias: object) -> Optional[dict[int, float]]:
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token_id: bias}}, got {logit_bias!r}")
        verified = {}
        for token_id, bias in logit_bias.items():
            if isinstance(token_id, str) and token_id.strip().lstrip("-").isdigit():
                token_id = int(token_id)
            _check_int("logit_bias key", token_id, minimum=0)
            _check_number(f"logit_bias[{token_id}]", bias)
            verified[token_id] = float(bias)
        return verified

    def verify_vocab(self, vocab_size: int) -> None:
        """Check the token ids given in the parameters against the model's vocabulary.

        Raises:
            ValueError: a ``stop_token_ids``, ``allowed_token_ids`` or ``logit_bias`` id outside
                ``[0, vocab_size)``.
        """
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("logit_bias", list(self.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    def tokenize_bad_words(self, tokenizer) -> None:
        """Fill the token ids of ``bad_words``, each word with and without a leading space
        (vLLM ``SamplingParams.update_from_tokenizer``), since a BPE spells both differently.

        Raises:
            ValueError: ``bad_words`` given but no tokenizer, or ``bad_words`` whose one-token
                spellings ban every id of ``allowed_token_ids`` (nothing would be left to sample).
        """
        if not self.bad_words:
            return
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        token_ids: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in token_ids:
                    token_ids.append(ids)
        banned = {ids[0] for ids in token_ids if len(ids) == 1}
        if self.allowed_token_ids and banned.issuperset(self.allowed_token_ids):
            raise ValueError(f"bad_words {self.bad_words!r} ban every token of allowed_token_ids "
                             f"{self.allowed_token_ids!r}: nothing would be left to sample")
        self._bad_words_token_ids = token_ids

    @property
    def greedy(self) -> bool:
        """True when sampling is an argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _check_int(name: str, value: object, minimum: Union[int, None] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_range(name: str, value: object, low: float, high: float) -> None:
    _check_number(name, value)
    assert isinstance(value, (int, float))  # _check_number raised otherwise
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_token_list(name: str, value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for token_id in value:
        _check_int(f"{name} entry", token_id, minimum=0)
    return list(value)
