"""Request traces: one JSON request per line (the input of ``pagedllm plan`` and what
``pagedllm serve --request-log`` writes).

Each line is an object with:

- ``arrival``: seconds (0 to ``MAX_ARRIVAL_S``) at which the request arrives; the file need
  not be sorted.
- the prompt, exactly one of ``prompt_tokens`` (a count), ``prompt_token_ids`` (a list) or
  ``prompt`` (text, tokenized with the model's tokenizer);
- ``output_tokens``: tokens the request generates (>= 1; it runs until then, EOS ignored);
- optionally, with ``prompt_tokens`` only, ``prefix_id`` (a string) and ``prefix_tokens``
  (>= 1, at most ``prompt_tokens``): the first ``prefix_tokens`` prompt tokens are the same
  for every request of that ``prefix_id`` (a system prompt, a few-shot header), so the
  replay's prefix cache hits on them exactly as the engine's would;
- optionally ``id`` (a string) to name the request in reports.

A count becomes token ids here: a prefix's ids are a fixed pseudo-random stream of its
``prefix_id`` (a longer ``prefix_tokens`` extends a shorter one), the rest of the prompt a
stream of its own line, so that distinct requests never share a block by accident.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

_PROMPT_KEYS = ("prompt_tokens", "prompt_token_ids", "prompt")
_KNOWN_KEYS = {"arrival", "output_tokens", "prefix_id", "prefix_tokens", "id", *_PROMPT_KEYS}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, with its prompt as token ids.

    Attributes:
        request_id: the line's ``id``, else ``"line-N"``.
        arrival_time: seconds.
        prompt_token_ids: the prompt (length >= 1).
        output_tokens: tokens generated (>= 1).
        prefix_id: the shared-prefix group, or None.
        line: 1-based line number in the file.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    prefix_id: Optional[str]
    line: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: the most KV the request ever holds."""
        return len(self.prompt_token_ids) + self.output_tokens


# Ten years: a replay adds millisecond steps to its clock, which a float keeps to ~1e-7 s here
# (an arrival of 1e300 s would stop it).
MAX_ARRIVAL_S = 10 * 365 * 86400
MAX_PROMPT_TOKENS = 1 << 24  # longer than any model's context; a prompt's ids are materialized


def _positive_int(value: Any, name: str, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (longer than any model's context), got {value}")
    return value


def _token_stream(seed: str, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)  # a str seed is hashed with SHA-512: the same ids on every run
    return [rng.randrange(vocab_size) for _ in range(length)]


def parse_request(obj: Any, line: int, vocab_size: int,
                  encode: Optional[Callable[[str], list[int]]] = None) -> TraceRequest:
    """One trace line's object as a ``TraceRequest``.

    Args:
        obj: the parsed JSON value.
        line: its 1-based line number (names the request, seeds its synthetic ids).
        vocab_size: synthetic and given token ids lie in ``[0, vocab_size)``.
        encode: text -> token ids, for ``prompt``; None refuses text prompts.

    Raises:
        ValueError: a missing or malformed field (the message names it; the caller adds the
            line number).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(sorted(_KNOWN_KEYS))})")
    arrival = obj.get("arrival")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival <= MAX_ARRIVAL_S:
        raise ValueError(f"arrival must be a number of seconds in [0, {MAX_ARRIVAL_S}] (ten years), got {arrival!r}")
    output_tokens = _positive_int(obj.get("output_tokens"), "output_tokens")
    given = [key for key in _PROMPT_KEYS if key in obj]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(_PROMPT_KEYS)}, got {given or 'none'}")
    prefix_id, prefix_tokens = obj.get("prefix_id"), obj.get("prefix_tokens")
    if given[0] != "prompt_tokens" and (prefix_id is not None or prefix_tokens is not None):
        raise ValueError("prefix_id/prefix_tokens go with prompt_tokens only: token ids and text "
                         "already say what they share")
    if given[0] == "prompt_tokens":
        num_prompt = _positive_int(obj["prompt_tokens"], "prompt_tokens", MAX_PROMPT_TOKENS)
        if (prefix_id is None) != (prefix_tokens is None):
            raise ValueError("prefix_id and prefix_tokens go together")
        num_prefix = 0
        if prefix_id is not None:
            if not isinstance(prefix_id, str) or not prefix_id:
                raise ValueError(f"prefix_id must be a non-empty string, got {prefix_id!r}")
            num_prefix = _positive_int(prefix_tokens, "prefix_tokens")
            if num_prefix > num_prompt:
                raise ValueError(f"prefix_tokens ({num_prefix}) is larger than prompt_tokens ({num_prompt})")
        token_ids = (_token_stream(f"prefix:{prefix_id}", num_prefix, vocab_size) if num_prefix else []) + \
            _token_stream(f"line:{line}", num_prompt - num_prefix, vocab_size)
    elif given[0] == "prompt_token_ids":
        token_ids = obj["prompt_token_ids"]
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    else:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompt must be a non-empty string (a count is prompt_tokens, token ids are "
                             f"prompt_token_ids), got {text!r}")
        if encode is None:
            raise ValueError("a text prompt needs the model's tokenizer (give --model, or prompt_tokens)")
        token_ids = list(encode(text))
        if not token_ids:
            raise ValueError(f"prompt {text!r} has no tokens")
    request_id = obj.get("id", f"line-{line}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"id must be a non-empty string, got {request_id!r}")
    return TraceRequest(request_id, float(arrival), tuple(token_ids), output_tokens, prefix_id, line)


def load_trace(source: Union[str, Path, Iterable[str]], vocab_size: int,
               encode: Optional[Callable[[str], list[int]]] = None) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines are skipped), sorted by arrival (ties keep file order).

    Args:
        source: a path, or the lines themselves.
        vocab_size: see ``parse_request``.
        encode: see ``parse_request``.

    Raises:
        ValueError: ``"<name> line N: <what is wrong>"`` for the first bad line, duplicate
            ids, or a trace without requests.
    """
    name = "trace"
    if isinstance(source, (str, Path)):
        name = str(source)
        try:
            lines = Path(source).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read trace {name}: {exc}") from None
    else:
        lines = list(source)
    requests: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} line {number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        try:
            request = parse_request(obj, number, vocab_size, encode)
        except ValueError as exc:
            raise ValueError(f"{name} line {number}: {exc}") from None
        if request.request_id in seen:
            raise ValueError(f"{name} line {number}: id {request.request_id!r} is already used on line "
                             f"{seen[request.request_id]}")
        seen[request.request_id] = number
        requests.append(request)
    if not requests:
        raise ValueError(f"{name} holds no request")
    requests.sort(key=lambda r: r.arrival_time)
    return requests

