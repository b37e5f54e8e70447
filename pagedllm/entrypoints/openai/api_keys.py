"""API keys with per-key limits: token buckets for requests and tokens per minute, a
concurrency cap, a default priority, and OpenAI's ``x-ratelimit-*`` headers.

A keys file (``--api-keys-file``, or the same JSON in ``$PAGEDLLM_API_KEYS``) is a JSON list:

    [{"name": "team-a", "key": "sk-...", "requests_per_minute": 60, "tokens_per_minute": 20000,
      "max_concurrent_requests": 4, "priority": 0, "lora_adapters": ["team-a-sql"]}, ...]

Only ``name`` and ``key`` are required; a missing limit is no limit. Names label metrics and
logs; keys are never logged or shown in an error message.

Buckets (the token bucket of Turner's leaky-bucket-as-a-meter, as OpenAI describes its limits):
a per-minute limit ``L`` is a bucket of ``L`` tokens refilled continuously at ``L / 60`` per
second. A request takes one request token and ``cost`` tokens, where ``cost`` is, over its
prompts, ``prompt tokens + n * max_tokens`` (``max_tokens`` resolved as the engine does: a chat
without it reserves the rest of the context). When it ends, the tokens it did not use go back:
it is charged the ``usage.total_tokens`` of the outputs its client got (prompt once per prompt,
plus every generated token). A request refused before it reached the engine (429, 503, a bad
prompt) gives everything back, its request token included. Each key has its own buckets, so
one key at its limit never slows another.

Headers (OpenAI's, https://platform.openai.com/docs/guides/rate-limits): on every response to
a key with a limit, ``x-ratelimit-limit-{requests,tokens}`` (the per-minute limit),
``x-ratelimit-remaining-{requests,tokens}`` (whole tokens left in the bucket now) and
``x-ratelimit-reset-{requests,tokens}`` (time until the bucket is full again, written as OpenAI
writes it: ``"17ms"``, ``"1.5s"``, ``"6m0s"``). A 429 also has ``Retry-After``: whole seconds
until the request could be admitted.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ANONYMOUS = "anonymous"  # the name of every client when the server has no key
DEFAULT_KEY_NAME = "default"  # the name of --api-key's key
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


@dataclass(frozen=True)
class APIKey:
    """One client key and its limits (None: no limit).

    Attributes:
        name: label for metrics and logs (never the key).
        key: the bearer token (kept out of ``repr``).
        requests_per_minute: request bucket size (requests; refills in 60 s).
        tokens_per_minute: token bucket size (tokens; refills in 60 s).
        max_concurrent_requests: requests of this key open at once.
        priority: the default ``priority`` of its requests, and the most urgent (lowest) one
            they may ask for; None: default 0, any value allowed.
        lora_adapters: the LoRA adapters (by name) its requests may use and ``/v1/models``
            shows it, besides the base model; None: all of them.
    """

    name: str
    key: str = field(repr=False)
    requests_per_minute: Optional[int] = None
    tokens_per_minute: Optional[int] = None
    max_concurrent_requests: Optional[int] = None
    priority: Optional[int] = None
    lora_adapters: Optional[frozenset[str]] = None


def parse_api_keys(text: str, source: str) -> list[APIKey]:
    """The keys of a keys file's JSON ``text`` (``source`` names it in errors).

    Raises:
        ValueError: not a JSON list of objects; an entry without a valid ``name`` (1-64 of
            ``A-Z a-z 0-9 _ . -``, not ``anonymous``) or a non-empty string ``key``; an unknown
            field; a limit that is not a positive integer; a non-integer priority;
            ``lora_adapters`` that is not a list of names; a name or
            a key used twice. The message names the entry and the field, never a key.
    """
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: must be a non-empty JSON list of key objects")
    keys: list[APIKey] = []
    names: set[str] = set()
    secrets: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"{source}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name == ANONYMOUS:
            raise ValueError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 _ . - and not "
                             f"{ANONYMOUS!r}, got {name!r}")
        where = f"{source}: key {name!r}"
        unknown = set(entry) - {"name", "key", "priority", "lora_adapters", *_LIMITS}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: name, key, priority, "
                             f"lora_adapters, {', '.join(_LIMITS)}")
        secret = entry.get("key")
        if not isinstance(secret, str) or not secret or secret != secret.strip():
            raise ValueError(f"{where}: key must be a non-empty string without surrounding spaces")
        for limit in _LIMITS:
            value = entry.get(limit)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{where}: {limit} must be a positive integer or null, got {value!r}")
        priority = entry.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
        adapters = entry.get("lora_adapters")
        if adapters is not None and (not isinstance(adapters, list)
                                     or not all(isinstance(a, str) and a for a in adapters)):
            raise ValueError(f"{where}: lora_adapters must be a list of adapter names or null, got {adapters!r}")
        if name in names:
            raise ValueError(f"{where}: the name is used twice")
        if secret in secrets:
            raise ValueError(f"{where}: its key is also another entry's key")
        names.add(name)
        secrets.add(secret)
        keys.append(APIKey(name, secret, *(entry.get(limit) for limit in _LIMITS), priority,
                           None if adapters is None else frozenset(adapters)))
    return keys


def load_api_keys(path: str) -> list[APIKey]:
    """``parse_api_keys`` of the file at ``path``.

    Raises:
        ValueError: the file cannot be read, or as ``parse_api_keys``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    return parse_api_keys(text, f"--api-keys-file {path}")


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's
    ``time.Duration``): ``"0s"``, ``"17ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h0m0s"``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


class TokenBucket:
    """``capacity`` tokens, refilled continuously at ``capacity / 60`` per second.

    The level may go below zero when a request used more than it reserved (it cannot here:
    the reservation is the most a request can use), and never above ``capacity``.
    """

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0  # tokens per second
        self.level = float(capacity)
        self.time = now

    def _refill(self, now: float) -> None:
        if now > self.time:
            self.level = min(self.capacity, self.level + (now - self.time) * self.rate)
            self.time = now

    def wait_time(self, amount: int, now: float) -> float:
        """Seconds until ``amount`` tokens are in the bucket (0.0: now; inf: never)."""
        if amount > self.capacity:
            return math.inf
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, math.floor(self.level + 1e-9))

    def reset_time(self, now: float) -> float:
        """Seconds until the bucket is full."""
        self._refill(now)
        return (self.capacity - self.level) / self.rate


class RateLimitError(Exception):
    """A key is over a limit: answered 429 with ``Retry-After: retry_after`` (None: the
    request can never fit, so no Retry-After)."""

    def __init__(self, message: str, retry_after: Optional[int]) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _KeyState:
    def __init__(self, key: APIKey, now: float) -> None:
        self.key = key
        self.requests = TokenBucket(key.requests_per_minute, now) if key.requests_per_minute else None
        self.tokens = TokenBucket(key.tokens_per_minute, now) if key.tokens_per_minute else None
        self.num_open = 0


class Admission:
    """One admitted request's hold on its key: the request token, ``reserved`` tokens and a
    concurrency seat. ``finish`` or ``cancel`` releases it (the first call counts)."""

    def __init__(self, limiter: "RateLimiter", state: Optional[_KeyState], reserved: int) -> None:
        self._limiter = limiter
        self._state = state
        self.reserved = reserved
        self.done = False

    def finish(self, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: give back the rest of the reservation."""
        if self.done:
            return
        self.done = True
        self._limiter._release(self._state, self.reserved - used_tokens, refund_request=False, used=used_tokens)

    def cancel(self) -> None:
        """The request never reached the engine: give everything back."""
        if self.done:
            return
        self.done = True
        self._limiter._release(self._state, self.reserved, refund_request=True, used=0)


class RateLimiter:
    """Every key's buckets and open-request counts (event loop thread only).

    Args:
        keys: the configured keys.
        clock: monotonic seconds (tests pass a fake one).
        on_event: called with ``(key name, event, value)`` for metrics: ``("rate_limited", 1)``,
            ``("tokens", used)``, ``("open", open requests now)``.
    """

    def __init__(self, keys: list[APIKey], clock: Callable[[], float] = time.monotonic,
                 on_event: Optional[Callable[[str, str, int], None]] = None) -> None:
        self.clock = clock
        now = clock()
        self._states = {key.name: _KeyState(key, now) for key in keys}
        self._on_event = on_event or (lambda name, event, value: None)

    def admit(self, key: Optional[APIKey], cost: int) -> Admission:
        """Take a request token, ``cost`` tokens and a seat of ``key`` (None: anonymous, no
        limits), all or nothing.

        Raises:
            RateLimitError: the key has ``max_concurrent_requests`` open, or its request or
                token bucket lacks what the request takes (``Retry-After``: whole seconds
                until it would not), or ``cost`` exceeds its ``tokens_per_minute``.
        """
        name = key.name if key is not None else ANONYMOUS
        state = self._states.get(name)
        if state is None:
            return Admission(self, None, cost)
        now = self.clock()
        limits = state.key
        if limits.max_concurrent_requests is not None and state.num_open >= limits.max_concurrent_requests:
            self._on_event(name, "rate_limited", 1)
            raise RateLimitError(f"API key {name!r} has {state.num_open} requests open, its "
                                 f"max_concurrent_requests: retry when one ends", 1)
        waits = []
        if state.requests is not None:
            waits.append(("requests_per_minute", limits.requests_per_minute, 1, state.requests.wait_time(1, now)))
        if state.tokens is not None:
            waits.append(("tokens_per_minute", limits.tokens_per_minute, cost, state.tokens.wait_time(cost, now)))
        for limit, value, amount, wait in waits:
            if wait == math.inf:
                self._on_event(name, "rate_limited", 1)
                raise RateLimitError(f"the request needs {amount} tokens (prompt + n * max_tokens), more than "
                                     f"the {limit} of API key {name!r} ({value}): lower max_tokens", None)
        wait = max((w for *_, w in waits), default=0.0)
        if wait > 0:
            limit = max(waits, key=lambda w: w[3])
            self._on_event(name, "rate_limited", 1)
            raise RateLimitError(f"API key {name!r} is over its {limit[0]} of {limit[1]} (this request takes "
                                 f"{limit[2]}): retry in {wait:.1f} s", max(1, math.ceil(wait)))
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(cost, now)
        state.num_open += 1
        self._on_event(name, "open", state.num_open)
        return Admission(self, state, cost)

    def counts_tokens(self, key: Optional[APIKey]) -> bool:
        """Whether ``key`` has a tokens-per-minute limit (only then is a request's cost computed)."""
        state = self._states.get(key.name) if key is not None else None
        return state is not None and state.tokens is not None

    def _release(self, state: Optional[_KeyState], tokens: int, refund_request: bool, used: int) -> None:
        name = state.key.name if state is not None else ANONYMOUS
        if used:
            self._on_event(name, "tokens", used)
        if state is None:
            return
        now = self.clock()
        if state.tokens is not None:
            if tokens >= 0:
                state.tokens.give_back(tokens, now)
            else:
                state.tokens.take(-tokens, now)
        if refund_request and state.requests is not None:
            state.requests.give_back(1, now)
        state.num_open -= 1
        self._on_event(name, "open", state.num_open)

    def headers(self, key: Optional[APIKey]) -> list[tuple[bytes, bytes]]:
        """The ``x-ratelimit-*`` headers of ``key`` now (none for a key without limits)."""
        state = self._states.get(key.name) if key is not None else None
        if state is None:
            return []
        now = self.clock()
        headers = []
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is None:
                continue
            headers += [(f"x-ratelimit-limit-{kind}".encode(), str(bucket.capacity).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(bucket.remaining(now)).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), format_reset(bucket.reset_time(now)).encode())]
        return headers


class KeyRing:
    """Bearer token -> ``APIKey``, compared by SHA-256 digest so that lookup time does not
    depend on how much of a wrong key matches."""

    def __init__(self, keys: list[APIKey]) -> None:
        self._by_digest = {hashlib.sha256(key.key.encode()).digest(): key for key in keys}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def find(self, token: bytes) -> Optional[APIKey]:
        return self._by_digest.get(hashlib.sha256(token).digest())
