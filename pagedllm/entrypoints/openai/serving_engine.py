"""What completions and chat completions share: errors, model names, streams, SSE, usage.

Mirrors the role of vLLM's ``vllm/entrypoints/openai/serving_engine.py``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.protocol import EngineClient, OutputStream
from pagedllm.entrypoints.openai.api_keys import ANONYMOUS, Admission, APIKey, RateLimiter, RateLimitError
from pagedllm.entrypoints.openai.errors import OpenAIError, to_openai_error, value_error
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ChoiceState:
    """What a stream has sent of one choice."""

    index: int
    started: bool = False  # the first chunk (chat role, echoed prompt) went out
    num_sent_chars: int = 0  # of the generated text
    num_sent_tokens: int = 0
    text_offset: int = 0  # characters of the choice's text sent, echoed prompt included
    finished: bool = False
    sent_arguments: list[int] = field(default_factory=list)  # tool_choice "required": per call, characters sent


@dataclass(frozen=True)
class ClientContext:
    """Who sent a request, as the server's middleware found it (``scope["state"]``).

    Attributes:
        key: the caller's API key (None: the server has no keys; the caller is anonymous).
        request_id: the client's ``X-Request-Id``, or one the server made up. Only ever
            compared within the same key, never used as an engine id.
    """

    key: Optional[APIKey]
    request_id: str

    @property
    def key_name(self) -> str:
        return self.key.name if self.key is not None else ANONYMOUS


def client_context(raw_request: Request) -> ClientContext:
    state = raw_request.scope.get("state") or {}
    return ClientContext(state.get("api_key"), state.get("client_request_id") or uuid.uuid4().hex)


class Submission:
    """One API request's engine requests, its rate-limit admission and its place in the
    registry. ``close()`` (idempotent) ends all three: unfinished engine requests are aborted,
    the key is charged the prompt and generated tokens of the outputs so far (a client that
    left is charged what was generated until then), the id is forgotten."""

    def __init__(self, context: ClientContext, response_id: str, streams: list[OutputStream],
                 admission: Admission, registry: "RequestRegistry") -> None:
        self.context = context
        self.response_id = response_id
        self.streams = streams
        self.admission = admission
        self.registry = registry
        self.ids = tuple(dict.fromkeys((context.request_id, response_id)))
        self.closed = False
        self.cancelled = False

    def add(self, stream: OutputStream) -> None:
        """One more engine request, aborted at once if the submission was cancelled while it
        was being added."""
        self.streams.append(stream)
        if self.cancelled:
            stream.abort()

    def cancel(self) -> None:
        """Abort every engine request, and those added from now on: each reader gets its final
        output (finish reason ``"abort"``)."""
        self.cancelled = True
        for stream in self.streams:
            stream.abort()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.close()
        used = usage([stream.last_output for stream in self.streams])["total_tokens"]
        self.admission.finish(used)
        self.registry.remove(self)
        logger.info("request %s (X-Request-Id %r, key %s) ended: %d tokens", self.response_id,
                    self.context.request_id, self.context.key_name, used)


class RequestRegistry:
    """The open API requests by ``(key name, id)``, ``id`` being the client's
    ``X-Request-Id`` or the response ``id``: what ``POST /v1/requests/{id}/cancel`` looks up.
    A key only ever finds its own requests. Event loop thread only."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], list[Submission]] = {}

    def add(self, submission: Submission) -> None:
        for request_id in submission.ids:
            self._open.setdefault((submission.context.key_name, request_id), []).append(submission)

    def remove(self, submission: Submission) -> None:
        for request_id in submission.ids:
            entry = (submission.context.key_name, request_id)
            submissions = self._open.get(entry, [])
            if submission in submissions:
                submissions.remove(submission)
            if not submissions:
                self._open.pop(entry, None)

    def cancel(self, key_name: str, request_id: str) -> int:
        """Abort the open requests of ``key_name`` known by ``request_id``; returns how many."""
        submissions = list(self._open.get((key_name, request_id), []))
        for submission in submissions:
            submission.cancel()
        return len(submissions)


@dataclass
class ServerPolicy:
    """What the server enforces around the engine (one instance shared by every handler).

    Attributes:
        limiter: per-key limits.
        registry: open requests, for cancellation.
        max_queue_wait: refuse (503) a request whose estimated wait exceeds this many seconds
            (None: only ``request_timeout`` bounds it).
        record: metrics' ``(key name, outcome, 1)`` for each request the engine accepted
            (``admitted``) or overload protection refused (``overloaded``).
    """

    limiter: RateLimiter
    registry: RequestRegistry
    max_queue_wait: Optional[float] = None
    record: Callable[[str, str, int], None] = lambda key_name, outcome, count: None


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the running engine: an ``AsyncLLMEngine``, or Ray Serve replicas behind a
            ``RayEngineClient`` (``engine/protocol.py``).
        served_model_names: names accepted in ``model``; the first one is reported.
        policy: limits, cancellation registry and overload settings (default: none).
        models: the base model's names and the LoRA adapters (``serving_models.py``; default:
            the names, no adapters), shared by the handlers.
    """

    def __init__(self, engine: EngineClient, served_model_names: Sequence[str],
                 policy: Optional[ServerPolicy] = None, models: Optional[OpenAIServingModels] = None) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.models = models or OpenAIServingModels(engine, served_model_names, self.model_name)
        self.tokenizer = engine.model_info.tokenizer
        # Stateless over the fixed model info: worker threads tokenize as the engine would.
        self.input_processor = InputProcessor(engine.model_info)
        self.max_model_len = engine.model_info.max_model_len
        self.policy = policy or ServerPolicy(RateLimiter([]), RequestRegistry())

    def check_model(self, model: Optional[str]) -> None:
        """Raises: OpenAIError 404 for a model this server does not serve (neither a base
        model name nor a loaded LoRA adapter)."""
        self.models.resolve(model)

    def response_model(self, model: Optional[str]) -> str:
        """The ``model`` a response reports: the adapter a request named, else the base model's
        first name."""
        return model if model is not None and model in self.models.lora_requests else self.model_name

    def check_request(self, request: Any) -> None:
        """What completions and chat check before anything else.

        Unknown fields are ignored, as vLLM ignores them, and logged; but ``use_beam_search:
        true`` (vLLM's beam search over HTTP) would silently sample instead: refused.

        Raises:
            OpenAIError: 404 unknown model; 400 ``stream_options`` without ``stream`` (as vLLM),
                or ``use_beam_search`` (beam search is ``LLM.beam_search``, not served).
        """
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        extra = request.model_extra or {}
        if extra.get("use_beam_search"):
            raise OpenAIError(400, "use_beam_search is not supported by this server: beam search runs "
                                   "offline through LLM.beam_search", param="use_beam_search")
        if extra:
            logger.warning("fields ignored in a request: %s", ", ".join(sorted(extra)))

    def encode_text(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """``text`` through the tokenizer (``kwargs`` go to ``encode``). Blocks for as long as
        the tokenizer takes: handlers call it in a worker thread.

        Raises:
            OpenAIError 400: no tokenizer, text too long for ``max_model_len`` (refused before
                it is tokenized), or text that is not valid UTF-8 (a lone surrogate).
        """
        self.require_tokenizer("tokenize")
        try:
            return self.input_processor.encode(text, param, **kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=param) from exc

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise OpenAIError(400, f"{what} needs a tokenizer and this model has none: send token ids")
        return self.tokenizer

    def resolve_priority(self, requested: Optional[int], key: Optional[APIKey]) -> int:
        """The request's ``priority``: its own, else its key's, else 0.

        Raises:
            OpenAIError 400: a priority more urgent (lower) than its key's.
        """
        floor = key.priority if key is not None else None
        if requested is None:
            return floor or 0
        if floor is not None and requested < floor:
            raise OpenAIError(400, f"priority {requested} is more urgent than API key {key.name!r} may ask "
                                   f"for: its requests may use priority >= {floor}", param="priority")
        return requested

    async def tokenize_prompts(self, prompts: Sequence[PromptType],
                               truncate: Optional[int] = None) -> list[PromptType]:
        """Text prompts as ``{"prompt", "prompt_token_ids"}`` (the last ``truncate`` ids, given
        ``InputProcessor.truncation``), tokenized in a worker thread:
        neither the event loop (every other request) nor the engine thread (every running
        sequence) waits for a long prompt's tokenizer. Token id prompts pass as they are.

        Raises:
            OpenAIError 400: a prompt the engine would refuse for its form, length or encoding.
        """
        if not any(isinstance(prompt, str) for prompt in prompts):
            return list(prompts)

        def tokenize_all() -> list[PromptType]:
            return [dict(zip(("prompt", "prompt_token_ids"), self.input_processor.tokenize(prompt, truncate)))
                    if isinstance(prompt, str) else prompt for prompt in prompts]
        try:
            return await asyncio.to_thread(tokenize_all)
        except ValueError as exc:
            raise value_error(exc) from exc

    def request_cost(self, prompts: Sequence[PromptType], params: SamplingParams) -> int:
        """Tokens a request reserves: over its prompts, ``prompt tokens + n * max_tokens``
        (``max_tokens`` resolved as the engine resolves it).

        Raises:
            OpenAIError 400: a prompt the engine would refuse for its length or encoding.
        """
        cost = 0
        try:
            for prompt in prompts:
                _, token_ids = self.input_processor.tokenize(prompt, self.input_processor.truncation(params))
                cost += len(token_ids) + params.n * self.input_processor.resolve_max_tokens(
                    len(token_ids), params.max_tokens)
        except ValueError as exc:
            raise value_error(exc) from exc
        return cost

    def check_overload(self, priority: int) -> None:
        """Refuse at once what cannot start in time: the estimated wait of a new request of
        ``priority`` (``LoadStats.estimated_wait``, from the engine thread's snapshots)
        against ``max_queue_wait`` and the server's ``request_timeout``.

        Raises:
            OpenAIError 503: with ``Retry-After`` (whole seconds by which the wait exceeds the
                limit, at least 1).
        """
        limits = [limit for limit in (self.policy.max_queue_wait, self.engine.request_timeout) if limit is not None]
        if not limits or not self.engine.is_healthy or self.engine.draining:
            return  # the engine refuses those itself, with their own reasons
        limit = min(limits)
        info = self.engine.model_info
        wait = self.engine.load.estimated_wait(self.engine.stats, info.max_num_seqs,
                                               priority if info.scheduling_policy == "priority" else None)
        if wait is not None and wait > limit:
            raise OpenAIError(503, f"the server is overloaded: a new request would wait about {wait:.1f} s to "
                                   f"start, more than the {limit:g} s allowed: retry later",
                              "ServiceUnavailableError",
                              headers={"Retry-After": str(max(1, math.ceil(wait - limit)))})

    async def submit(self, raw_request: Request, prefix: str, prompts: Sequence[PromptType],
                     params: SamplingParams, cache_salt: Optional[str],
                     priority: Optional[int], model: Optional[str] = None) -> Submission:
        """Admit a request and add one engine request per prompt, all or none.

        In order: the LoRA adapter ``model`` names, if the key may use it (404), the key's
        priority rule (400), the text prompts' tokenization (400, see
        ``tokenize_prompts``), every prompt's checks (400, ``InputProcessor.check_prompt``),
        its rate limits (429), overload protection (503), then the engine
        (400, 429 queue full, 503 draining or dead). The response id is
        ``{prefix}-{X-Request-Id}`` (vLLM's form); engine ids are ``{key name}/{uuid}-{i}``,
        never derived from the client's id, so no client can name or collide with another's.

        Raises:
            OpenAIError: as above; what was taken is given back.
        """
        context = client_context(raw_request)
        lora_request = self.models.resolve(model, context.key)
        priority = self.resolve_priority(priority, context.key)
        truncate = self.input_processor.truncation(params)
        prompts = await self.tokenize_prompts(prompts, truncate)
        try:  # every prompt before any reaches the engine: a bad one must not start the others
            for prompt in prompts:
                self.input_processor.check_prompt(self.input_processor.tokenize(prompt, truncate)[1], params)
        except ValueError as exc:
            raise value_error(exc) from exc
        limiter = self.policy.limiter
        cost = self.request_cost(prompts, params) if limiter.counts_tokens(context.key) else 0
        try:
            admission = limiter.admit(context.key, cost)
        except RateLimitError as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
            raise OpenAIError(429, str(exc), "RateLimitError", headers=headers) from None
        # In the registry before the first engine request is added, so that a cancel arriving
        # while the engine thread has not yet taken them (a step can last seconds) finds it.
        submission = Submission(context, f"{prefix}-{context.request_id}", [], admission, self.policy.registry)
        try:
            try:
                self.check_overload(priority)
            except OpenAIError:
                self.policy.record(context.key_name, "overloaded", 1)
                raise
            self.policy.registry.add(submission)
            base = f"{context.key_name}/{uuid.uuid4().hex}"
            for i, prompt in enumerate(prompts):
                submission.add(await self.engine.add_request(f"{base}-{i}", prompt, params, cache_salt, priority,
                                                             lora_request=lora_request))
        except BaseException as exc:
            for stream in submission.streams:
                stream.close()
            self.policy.registry.remove(submission)
            admission.cancel()
            if isinstance(exc, Exception):
                raise to_openai_error(exc) from exc
            raise
        self.policy.record(context.key_name, "admitted", 1)
        logger.info("request %s (X-Request-Id %r, key %s): %d prompt(s), priority %d, %d tokens reserved",
                    submission.response_id, context.request_id, context.key_name, len(prompts), priority, cost)
        return submission

    def decode_token(self, token_id: int, logprob: Optional[Logprob] = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def _byte_level_decoder(self) -> Optional[dict[str, int]]:
        """GPT-2's byte-to-character map reversed, where the tokenizer's decoder is
        ``ByteLevel``; None for others."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        return {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(self, token_id: int, logprob: Optional[Logprob] = None) -> list[int]:
        """The token's own bytes, OpenAI's ``logprobs.content[].bytes``: a token holding part
        of a UTF-8 character (an emoji, CJK) decodes alone to U+FFFD, but its bytes joined
        with its neighbours' give the text back. Byte-level BPE vocabularies (GPT-2's map,
        SmolLM2, Qwen) and SentencePiece byte pieces (``<0xE2>``: Gemma, Llama 2) are read as
        such; any other token as the UTF-8 of its text."""
        tokenizer = self.tokenizer
        if tokenizer is not None:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                byte_piece = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
                if byte_piece is not None:
                    return [int(byte_piece[1], 16)]
                decoder = self._byte_level_decoder
                if decoder is not None and all(char in decoder for char in piece):
                    return [decoder[char] for char in piece]
        return list(self.decode_token(token_id, logprob).encode())


def prompt_logprobs_json(engine: "OpenAIServing", output: RequestOutput) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` field (non-streaming responses): per prompt token ``None``
    (the first) or ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's own
    token first; None when they were not asked for."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": engine.decode_token(token_id, lp)}
             for token_id, lp in entry.items()}
            for entry in output.prompt_logprobs]


def now_seconds() -> int:
    return int(time.time())


def usage(outputs: Sequence[Optional[RequestOutput]]) -> dict[str, int]:
    """Usage over one request: each prompt counted once, every choice's tokens summed."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_usage(output: Optional[RequestOutput], index: int, num_prompt_tokens: int = 0) -> dict[str, int]:
    """Usage of one choice so far, as vLLM's ``continuous_usage_stats`` chunks carry it: its
    prompt's tokens and the tokens of its completion ``index`` (``num_prompt_tokens`` and 0
    before the first output)."""
    prompt_tokens = len(output.prompt_token_ids) if output is not None else num_prompt_tokens
    completion_tokens = sum(len(c.token_ids) for c in output.outputs if c.index == index) if output is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def merge_streams(streams: Sequence[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, output)`` from several streams as they come; closes them all at the end
    (which aborts those unfinished: the reader was cancelled or failed)."""
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            stream.close()


async def collect_final(streams: Sequence[OutputStream]) -> list[RequestOutput]:
    """The final output of every stream (in order).

    Raises:
        OpenAIError: the engine failed a request (timeout, drain, dead engine).
    """
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    for stream in streams:
        stream.final_only = True  # the client sees only the finals: a lost replica may be retried
    try:
        async for i, output in merge_streams(streams):
            finals[i] = output
    except Exception as exc:
        raise to_openai_error(exc) from exc
    return finals  # type: ignore[return-value]


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE chunks through; an engine error mid-stream becomes an ``{"error": ...}`` event
    (the OpenAI clients raise it); ``data: [DONE]`` always ends the stream."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield sse(to_openai_error(exc).body())
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that runs ``on_close`` however it ends.

    Starlette cancels the body iterator when the client disconnects; if that happens before
    the iterator started, its own ``finally`` never runs, so the streams are closed here too.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def run_until_disconnect(request: Request, handler: Callable[[], Any]) -> Response:
    """Await ``handler()`` unless the client disconnects first; then cancel it (its ``finally``
    blocks abort the engine requests) and answer nothing useful: the client is gone.

    The same idea as vLLM's ``with_cancellation`` (``vllm/entrypoints/utils.py``).
    """
    task = asyncio.ensure_future(handler())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return Response(status_code=499)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
