"""What completions and chat completions share: errors, model names, streams, SSE, usage.

Mirrors the role of vLLM's ``vllm/entrypoints/openai/serving_engine.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineDrainingError,
                                          QueueFullError, RequestFailedError, RequestStream,
                                          RequestTimeoutError)
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (also the ``code``).
        message: what went wrong, naming the field, the limit and the value where there is one.
        type: vLLM's error type names (``BadRequestError``, ``NotFoundError``, ...).
        param: the offending request field, if known.
        headers: extra response headers (``Retry-After`` for 429).
    """

    def __init__(self, status: int, message: str, type: str = "BadRequestError",
                 param: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return _ASCIIJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def sampling_params_error(exc: ValueError) -> OpenAIError:
    """A ``SamplingParams`` ``ValueError`` as a 400; its message starts with the field's name
    (``temperature must be >= 0, got -1``), which becomes ``param``."""
    field = str(exc).split(" ", 1)[0].rstrip(":")
    return OpenAIError(400, str(exc), param=field if field.isidentifier() else None)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote the request's text, and a lone
    surrogate in it (valid in JSON, not in UTF-8) must not break the error response itself."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map an engine exception to its HTTP error (anything unexpected is a 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):  # the engine's messages name the field and the value
        return OpenAIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), "RateLimitError", headers={"Retry-After": "1"})
    if isinstance(exc, (EngineDrainingError, EngineDeadError)):
        return OpenAIError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, str(exc), "TimeoutError")
    if isinstance(exc, RequestFailedError):  # the engine ended the request and keeps serving
        return OpenAIError(500, str(exc), "InternalServerError")
    return OpenAIError(500, f"internal error: {exc!r}", "InternalServerError")


@dataclass
class ChoiceState:
    """What a stream has sent of one choice."""

    index: int
    started: bool = False  # the first chunk (chat role, echoed prompt) went out
    num_sent_chars: int = 0  # of the generated text
    num_sent_tokens: int = 0
    text_offset: int = 0  # characters of the choice's text sent, echoed prompt included
    finished: bool = False


class OpenAIServing:
    """Base of the completion and chat handlers.

    Args:
        engine: the running ``AsyncLLMEngine``.
        served_model_names: names accepted in ``model``; the first one is reported.
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.tokenizer = engine.model_info.tokenizer
        # Stateless over the fixed model info: this thread tokenizes as the engine would.
        self.input_processor = InputProcessor(engine.model_info)
        self.max_model_len = engine.model_info.max_model_len

    def check_model(self, model: Optional[str]) -> None:
        """Raises: OpenAIError 404 for a model this server does not serve."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"{self.served_model_names}", "NotFoundError", "model")

    def check_request(self, request: Any) -> None:
        """What completions and chat check before anything else.

        Raises:
            OpenAIError: 404 unknown model; 400 ``stream_options`` without ``stream`` (as vLLM).
        """
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "Stream options can only be defined when `stream=True`.",
                              param="stream_options")

    def encode_text(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """``text`` through the tokenizer (``kwargs`` go to ``encode``).

        Raises:
            OpenAIError 400: no tokenizer, or text that is not valid UTF-8 (a lone surrogate).
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

    async def add_requests(self, request_id: str, prompts: Sequence[PromptType], params: SamplingParams,
                           cache_salt: Optional[str]) -> list[RequestStream]:
        """Add one engine request per prompt (ids ``{request_id}-{i}``); all or none.

        Raises:
            OpenAIError: 400, 429, 503 as the engine refuses (the ones already added are aborted).
        """
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params, cache_salt))
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, Exception):
                raise to_openai_error(exc) from exc
            raise
        return streams

    def decode_token(self, token_id: int, logprob: Optional[Logprob] = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


def usage(outputs: Sequence[Optional[RequestOutput]]) -> dict[str, int]:
    """Usage over one request: each prompt counted once, every choice's tokens summed."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion_tokens = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def collect_final(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream (in order).

    Raises:
        OpenAIError: the engine failed a request (timeout, drain, dead engine).
    """
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
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


def close_all(streams: Sequence[RequestStream]) -> Callable[[], None]:
    def close() -> None:
        for stream in streams:
            stream.close()
    return close


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
