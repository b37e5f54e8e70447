"""The OpenAI-compatible HTTP server: routes, API key, errors, SIGTERM drain (``pagedllm serve``).

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/v1/requests/{id}/cancel``, ``/health``, ``/livez``, ``/readyz``, ``/load``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics``, with ``--allow-runtime-lora-updating``
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``serving_models.py``), and the live
block-pool view (``/debug/kv``,
``/debug/kv/stream``, ``/dashboard``; off with ``--disable-dashboard``). With API keys
(``--api-key``, ``--api-keys-file``), every ``/v1`` and ``/debug`` path and
``/tokenize``/``/detokenize`` need ``Authorization: Bearer <key>`` (as vLLM); the probes,
``/load``, ``/version`` and ``/metrics`` stay open for platforms and scrapers, and so does
``/dashboard``: a static page with no data in it, which sends the key (typed in, or given as
``#key=...``, which browsers never send) on its reads of ``/debug/kv/stream``. Per-key limits,
their headers and 429s: ``api_keys.py``.

Every response carries ``X-Request-Id``: the client's (1-128 printable ASCII characters, no
spaces) or a new one. It names the request in logs, in the response ``id``
(``cmpl-<X-Request-Id>``, as vLLM) and in the cancel endpoint, always within the caller's key:
engine ids are made up by the server, so a client id can neither collide with nor reach
another key's request.

Health (all read the engine thread's snapshots, never the engine): ``/livez`` is 200 while the
engine loop runs (503 once it died: restart the process); ``/readyz`` is 200 when it also takes
requests (503 while draining); ``/health`` is vLLM's and answers as ``/readyz``; ``/load``
reports running and waiting sequences, KV cache usage, recent step time and finish rate and the
estimated wait of a new request. Overload protection refuses (503, ``Retry-After``) a request
whose estimated wait exceeds ``--max-queue-wait`` or ``--request-timeout``.

Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``, including
FastAPI's and Starlette's own (404 path, 405 method, a body that is not JSON): never
``{"detail": ...}``. Validation errors are 400s that name the field and quote the value.

Shutdown (SIGTERM or SIGINT): the server keeps listening but answers new requests and
``/health`` with 503, lets open requests run for up to ``--drain-timeout`` seconds, ends the
rest with a terminal error (an SSE error event, or a 503 JSON body), then exits with status 0.
The live KV view's streams end at once. A second signal ends the drain at once.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import re
import socket
import time
import uuid
from http import HTTPStatus
from pathlib import Path
from typing import Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm import envs
from pagedllm.config import DEFAULT_MAX_REQUEST_BODY_BYTES, EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.api_keys import (DEFAULT_KEY_NAME, APIKey, KeyRing, RateLimiter, load_api_keys,
                                                  parse_api_keys)
from pagedllm.engine.request_log import RequestLog
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import (OpenAIError, RequestRegistry, ServerPolicy, SSEResponse,
                                                        client_context, to_openai_error)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_modules
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import APIKeyMetrics, EngineMetrics
from pagedllm.models.loader import DEFAULT_MODEL_FILE

logger = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/debug")
_DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
_REQUEST_ID = re.compile(r"[\x21-\x2e\x30-\x7e]{1,128}")  # printable ASCII but "/": ids are path segments

# vLLM's error type names; other statuses get their phrase ("Payload Too Large" -> PayloadTooLargeError)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 422: "BadRequestError",
                429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def _short_repr(value: object, limit: int = 120) -> str:
    """``value`` as the client wrote it (JSON), cut to ``limit`` characters."""
    if isinstance(value, (bytes, bytearray)):  # a body that was not parsed as JSON
        text = repr(bytes(value[:limit]).decode("utf-8", "replace"))
        return text if len(value) <= limit else f"{text}... ({len(value)} bytes)"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _body_parse_error(cause: Optional[BaseException]) -> str:
    """Why FastAPI could not parse a body that is not a JSONDecodeError (it only says
    "There was an error parsing the body")."""
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid JSON: byte {cause.start} is not valid UTF-8"
    return "the request body is not valid JSON: it could not be parsed"


def _union_tag(part) -> bool:
    """Whether a pydantic ``loc`` part names a member of a union type (``list[int]``, ``str``)
    rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic/FastAPI validation error as a 400 that names the field."""
    errors = exc.errors()
    error = errors[0]
    kind = error.get("type")
    loc = [part for part in error.get("loc", ()) if part != "body" and not _union_tag(part)]
    if kind == "json_invalid":  # FastAPI puts the character position in loc
        reason = (error.get("ctx") or {}).get("error") or "malformed"
        where = f" at character {loc[0]}" if loc else ""
        return OpenAIError(400, f"the request body is not valid JSON: {reason}{where}")
    if not loc and kind == "missing":
        return OpenAIError(400, "the request body is empty: send a JSON object (Content-Type: application/json)")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return OpenAIError(400, "the request body must be a JSON object (sent with Content-Type: "
                                f"application/json), got {_short_repr(error.get('input'))}")
    param = ".".join(str(part) for part in loc) or None
    msg = str(error.get("msg"))
    msg = msg.removeprefix("Value error, ")  # a ValueError from a validator: its message is enough
    # A union field (the completions prompt) whose value is none of its forms fails once per
    # form, each error's loc ending in the form's name: name them all.
    forms = [e["loc"][-1] for e in errors if e.get("loc") and _union_tag(e["loc"][-1])
             and [p for p in e["loc"] if p != "body" and not _union_tag(p)] == loc]
    if len(forms) > 1:
        msg = "must be one of " + ", ".join(dict.fromkeys(forms))
    message = f"{param}: {msg}" if param else msg
    if "input" in error and kind != "missing" and kind != "value_error":
        message += f" (got {_short_repr(error['input'])})"
    return OpenAIError(400, message, param=param)


class _ClientMiddleware:
    """Who is calling, on every HTTP request; plain ASGI (not ``BaseHTTPMiddleware``, which
    would hide client disconnects).

    Puts ``client_request_id`` (``X-Request-Id``, checked, or a new one) and ``api_key`` (the
    caller's ``APIKey``; None when the server has no keys or the path is open) into
    ``scope["state"]``; answers 401 for a protected path without a known key, 400 for a
    malformed ``X-Request-Id`` and 413 for a body over ``max_body_bytes`` (read before the app
    sees it, so a huge body is refused at that size instead of filling the server's memory);
    adds ``X-Request-Id`` and the key's ``x-ratelimit-*`` headers to every response, errors
    included.
    """

    def __init__(self, app, keyring: KeyRing, limiter: RateLimiter, max_body_bytes: int) -> None:
        self.app = app
        self.keyring = keyring
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes

    async def read_body(self, headers: dict, receive):
        """The whole request body, read here, and a ``receive`` that hands it to the app as one
        message and then passes on what the client sends (a disconnect still reaches a stream).

        Returns ``(None, receive)`` when the client left while sending. Raises ``OpenAIError``
        413 past ``max_body_bytes``, by ``Content-Length`` before reading or while reading.
        """
        def too_large(size: str) -> OpenAIError:
            return OpenAIError(413, f"the request body is {size} bytes, over the server's limit of "
                                    f"{self.max_body_bytes} bytes (--max-request-body-bytes)", _error_type(413))

        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large(length.decode())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise too_large(f"more than {self.max_body_bytes}")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return body, replay

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error: Optional[OpenAIError] = None
        given = headers.get(b"x-request-id")
        request_id = given.decode("utf-8", "replace") if given is not None else uuid.uuid4().hex
        if not _REQUEST_ID.fullmatch(request_id):
            error = OpenAIError(400, "X-Request-Id must be 1-128 printable ASCII characters without spaces or '/', "
                                     f"got {_short_repr(request_id)}")
            request_id = uuid.uuid4().hex  # never echo what was refused
        key: Optional[APIKey] = None
        if error is None and self.keyring and scope["path"].startswith(_PROTECTED_PREFIXES):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # The scheme is case-insensitive (RFC 7235 section 2.1), the key is not.
            key = self.keyring.find(token) if scheme.lower() == b"bearer" else None
            if key is None:
                error = OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                    "AuthenticationError")
        state = scope.setdefault("state", {})
        state["client_request_id"] = request_id
        state["api_key"] = key

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"x-request-id", request_id.encode()), *self.limiter.headers(key)]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if error is None and scope["method"] not in ("GET", "HEAD"):
            try:
                body, receive = await self.read_body(headers, receive)
            except OpenAIError as exc:
                error = exc
            else:
                if body is None:
                    return
        if error is not None:
            await error.response()(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)


def build_app(engine: EngineClient, served_model_names: Sequence[str], api_key: Optional[str] = None,
              model_root: Optional[str] = None, api_keys: Sequence[APIKey] = (),
              max_queue_wait: Optional[float] = None, clock=time.monotonic,
              enable_dashboard: bool = True, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              lora_requests: Sequence[LoRARequest] = (), allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The FastAPI application over a started engine: an ``AsyncLLMEngine`` (``pagedllm
    serve``), or Ray Serve replicas through a ``RayEngineClient`` (``pagedllm serve --replicas``).

    Args:
        engine: the engine (its ``metrics``, if any, are served at /metrics, with the per-key
            series added).
        served_model_names: names clients may put in ``model``; the first is reported.
        api_key: one bearer token without limits, named ``default`` (None: none).
        model_root: what /v1/models reports as ``root`` (default: the first name).
        api_keys: keys with names and limits (``api_keys.py``). With neither ``api_key`` nor
            ``api_keys`` the API is open and every caller is ``anonymous``.
        max_queue_wait: overload protection's limit on a new request's estimated wait,
            seconds (None: only the engine's ``request_timeout``).
        clock: the rate limiter's monotonic clock, seconds (tests pass a fake one).
        enable_dashboard: serve ``/debug/kv``, ``/debug/kv/stream`` and ``/dashboard``
            (False: those paths are 404 and the engine never takes a block-pool snapshot).
            Only an ``AsyncLLMEngine`` has a block pool at hand.
        max_request_body_bytes: a larger request body is refused with 413 (bytes).
        lora_requests: LoRA adapters the engine has loaded (``--lora-modules``), served under
            their names (``serving_models.py``).
        allow_runtime_lora_updating: serve ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (404 otherwise).

    Raises:
        ValueError: no served model name, a dashboard asked of another engine client, a key
            name used twice, a key with a priority under the ``fcfs`` scheduling policy,
            ``max_queue_wait`` <= 0, ``max_request_body_bytes`` < 1.
    """
    if not max_request_body_bytes >= 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes!r}")
    if not served_model_names:
        raise ValueError("served_model_names must hold at least one name")
    if max_queue_wait is not None and not max_queue_wait > 0:
        raise ValueError(f"max_queue_wait must be > 0 seconds, got {max_queue_wait!r}")
    if enable_dashboard and not isinstance(engine, AsyncLLMEngine):
        raise ValueError(f"the dashboard reads a local engine's block pool; {type(engine).__name__} has none: "
                         "pass enable_dashboard=False")
    keys = list(api_keys) + ([APIKey(DEFAULT_KEY_NAME, api_key)] if api_key else [])
    names = [key.name for key in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"API key names must be unique, got {names} (--api-key's key is named "
                         f"{DEFAULT_KEY_NAME!r})")
    model_info = engine.model_info  # the event loop reads nothing of the LLMEngine itself
    with_priority = [key.name for key in keys if key.priority not in (None, 0)]
    if with_priority and model_info.scheduling_policy != "priority":
        raise ValueError(f"API keys {with_priority} set a priority, which needs --scheduling-policy priority "
                         f"(the engine schedules {model_info.scheduling_policy!r})")
    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    key_metrics = None
    if engine.metrics is not None:
        key_metrics = APIKeyMetrics(engine.metrics.registry, engine.metrics.model_name, names)
    limiter = RateLimiter(keys, clock, key_metrics.record if key_metrics is not None else None)
    registry = RequestRegistry()
    policy = ServerPolicy(limiter, registry, max_queue_wait)
    if key_metrics is not None:
        policy.record = key_metrics.record
    models = OpenAIServingModels(engine, served_model_names, model_root or served_model_names[0], lora_requests)
    completions = OpenAIServingCompletion(engine, served_model_names, policy, models)
    chat = OpenAIServingChat(engine, served_model_names, policy, models)
    created = int(time.time())
    app.add_middleware(_ClientMiddleware, keyring=KeyRing(keys), limiter=limiter,
                       max_body_bytes=max_request_body_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's and FastAPI's own errors (404 path, 405 method, unparsable body) as
        OpenAI JSON, never ``{"detail": ...}``."""
        status = exc.status_code
        if status == 400 and exc.detail == "There was an error parsing the body":
            message = _body_parse_error(exc.__cause__)
        elif status == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow")
            message = f"method {request.method} is not allowed on {request.url.path}" + (
                f" (allowed: {allowed})" if allowed else "")
        else:
            message = str(exc.detail)
        return OpenAIError(status, message, _error_type(status), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return to_openai_error(exc).response()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:
            return OpenAIError(503, f"the engine loop is dead: {engine.dead_error!r}",
                               "ServiceUnavailableError").response()
        if engine.draining:
            return OpenAIError(503, "the server is shutting down", "ServiceUnavailableError").response()
        return Response(status_code=200)

    @app.get("/livez")
    async def livez() -> Response:
        if not engine.is_healthy:
            return OpenAIError(503, f"the engine loop is dead: {engine.dead_error!r}",
                               "ServiceUnavailableError").response()
        return JSONResponse({"status": "alive"})

    @app.get("/readyz")
    async def readyz() -> Response:
        if not engine.is_healthy:
            return OpenAIError(503, f"the engine loop is dead: {engine.dead_error!r}",
                               "ServiceUnavailableError").response()
        if engine.draining:
            return OpenAIError(503, "the server is shutting down", "ServiceUnavailableError").response()
        return JSONResponse({"status": "ready"})

    @app.get("/load")
    async def load() -> dict:
        """The engine thread's newest snapshots (``SchedulerStats``, ``LoadStats``): the same
        counts as the ``/metrics`` gauges. Behind Ray Serve, those of the replica a new request
        would start soonest on, and under ``replicas`` each replica's last report (its prefix
        keys counted, not listed)."""
        stats, recent = engine.stats, engine.load
        wait = recent.estimated_wait(stats, model_info.max_num_seqs)
        reports = getattr(engine, "reports", None)
        replicas = {} if reports is None else {"replicas": {
            replica: {**{k: v for k, v in report.items() if k != "prefix_hashes"},
                      "num_prefix_keys": len(report.get("prefix_hashes", ()))}
            for replica, report in reports.items()}}
        return {**replicas, "running": stats.num_running_reqs, "waiting": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage, "num_blocks": stats.num_blocks,
                "num_used_blocks": stats.num_used_blocks, "max_num_seqs": model_info.max_num_seqs,
                "step_time_s": recent.step_time, "finish_rate": recent.finish_rate,
                "estimated_wait_s": wait, "open_requests": engine.num_open_requests,
                "healthy": engine.is_healthy, "draining": engine.draining}

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(raw_request: Request, request_id: str = PathParam(
            min_length=1, max_length=160, pattern=r"^[\x21-\x7e]+$",
            description="an X-Request-Id or a response id (cmpl-..., chatcmpl-...)")) -> dict:
        """Abort the caller's open requests known by ``request_id`` (their ``X-Request-Id`` or
        response ``id``); their clients get what was generated, finish reason ``abort``.
        Another key's request is not found (404), as a finished one."""
        context = client_context(raw_request)
        cancelled = registry.cancel(context.key_name, request_id)
        if not cancelled:
            raise OpenAIError(404, f"no open request {request_id!r} of this API key", "NotFoundError")
        logger.info("cancelled %d request(s) %r of key %s", cancelled, request_id, context.key_name)
        return {"id": request_id, "object": "request.cancelled", "cancelled": cancelled}

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def list_models(raw_request: Request) -> dict:
        return {"object": "list", "data": models.list_models(created, client_context(raw_request).key)}

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
            _check_may_update_loras(raw_request)
            return PlainTextResponse(await models.load_lora_adapter(request.lora_name, request.lora_path))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
            _check_may_update_loras(raw_request)
            return PlainTextResponse(await models.unload_lora_adapter(request.lora_name))

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        completions.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages")
        if request.messages is not None:
            _, tokens = await asyncio.to_thread(chat.render, request.messages, request.add_generation_prompt)
        else:
            tokens = await asyncio.to_thread(completions.encode_text, request.prompt, "prompt",
                                             add_special_tokens=request.add_special_tokens)
        return {"count": len(tokens), "max_model_len": model_info.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        completions.check_model(request.model)
        tokenizer = completions.require_tokenizer("detokenize")
        vocab_size = model_info.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                              param="tokens")
        return {"prompt": tokenizer.decode(request.tokens)}

    if enable_dashboard:
        _add_dashboard_routes(app, engine)
    return app


def _check_may_update_loras(raw_request: Request) -> None:
    """Raises: OpenAIError 403 for a key limited to some adapters (``lora_adapters``)."""
    key = client_context(raw_request).key
    if key is not None and key.lora_adapters is not None:
        raise OpenAIError(403, f"API key {key.name!r} is limited to some LoRA adapters and may not load or unload "
                               "adapters", "PermissionDeniedError")


def _add_dashboard_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """The live block-pool view: ``KVCacheSnapshot``s taken on the engine thread, as JSON
    (``/debug/kv``), as a server-sent event per new snapshot (``/debug/kv/stream``, a few per
    second while the engine steps) and drawn by a page (``/dashboard``)."""
    page = _DASHBOARD_HTML.read_text(encoding="utf-8")

    @app.get("/debug/kv")
    async def debug_kv() -> Response:
        try:
            snapshot = await engine.get_kv_snapshot()
        except Exception as exc:
            raise to_openai_error(exc) from None
        return Response(snapshot.json, media_type="application/json")

    @app.get("/debug/kv/stream", include_in_schema=False)  # endless: not for schema fuzzers
    async def debug_kv_stream() -> Response:
        if not engine.is_healthy:
            raise OpenAIError(503, f"the engine loop is dead: {engine.dead_error!r}", "ServiceUnavailableError")
        snapshots = engine.subscribe_kv()

        async def events():
            try:
                async for snapshot in snapshots:
                    yield f"id: {snapshot.version}\ndata: {snapshot.json}\n\n"
            except EngineDeadError:
                return  # end the stream; a reconnecting page then gets the 503

        # Closing the generator ends the subscription even when the client left between
        # two events (Starlette then never resumes it).
        return SSEResponse(events(), on_close=lambda: asyncio.ensure_future(snapshots.aclose()))

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM/SIGINT drains the engine before exiting (with
    status 0: uvicorn re-raises the signals it handled itself, which would end the process
    with -15). A second signal ends the drain at once: the open requests are aborted, so their
    responses end with an error and leave uvicorn no task to cancel (it would log each one's
    ``CancelledError`` traceback). A later signal is uvicorn's own (a SIGINT after the drain
    quits without waiting for connections)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_timeouts = [drain_timeout, 0.0]  # the first signal's drain, then the second's

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit or self._loop is None or not self._drain_timeouts:
            super().handle_exit(sig, frame)
            return
        timeout = self._drain_timeouts.pop(0)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(timeout)))

    async def _drain(self, timeout: float) -> None:
        logger.warning("shutting down: draining %d open requests for up to %g s",
                       self.engine.num_open_requests, timeout)
        aborted = await self.engine.drain(timeout)
        if aborted:
            logger.warning("aborted %d requests still open at the end of the drain", aborted)
        self.should_exit = True


def build_engine(engine_args: EngineArgs, engine_factory: Optional[str] = None,
                 lora_requests: Sequence[LoRARequest] = ()) -> LLMEngine:
    """The ``LLMEngine`` of ``engine_args``, or ``engine_factory(engine_args)``
    (``module:function``, the tests' ``--engine-factory``), with ``lora_requests`` loaded.

    Raises:
        ValueError: as ``LLMEngine``, or an adapter it refuses (``LLMEngine.add_lora``).
    """
    if engine_factory:
        module_name, _, function_name = engine_factory.partition(":")
        engine = getattr(importlib.import_module(module_name), function_name)(engine_args)
    else:
        engine = LLMEngine(engine_args)
    for lora_request in lora_requests:
        engine.add_lora(lora_request)
    return engine


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it.

    Raises:
        ValueError: the port is outside [0, 65535], or the address cannot be bound (in use,
            not local, no permission).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def server_api_keys(args: argparse.Namespace) -> tuple[Optional[str], list[APIKey]]:
    """``(--api-key or $PAGEDLLM_API_KEY, the keys of --api-keys-file or $PAGEDLLM_API_KEYS)``.

    Raises:
        ValueError: a keys file or variable that does not parse (``api_keys.py``).
    """
    api_keys = []
    if args.api_keys_file:
        api_keys = load_api_keys(args.api_keys_file)
    elif envs.PAGEDLLM_API_KEYS:
        api_keys = parse_api_keys(envs.PAGEDLLM_API_KEYS, "$PAGEDLLM_API_KEYS")
    return args.api_key or envs.PAGEDLLM_API_KEY, api_keys


def run_server(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Build the engine from the CLI options, serve until a signal, drain, return 0.

    Raises:
        ValueError: a bad option (engine options, --max-waiting-requests, --request-timeout,
            --drain-timeout, --max-queue-wait, --max-request-body-bytes, the keys file) or a
            configuration that cannot run.
    """
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_queue_wait is not None and not args.max_queue_wait > 0:
        raise ValueError(f"--max-queue-wait must be > 0 seconds, got {args.max_queue_wait}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    api_key, api_keys = server_api_keys(args)
    check_port_free(args.host, args.port)  # before seconds of model loading, not after
    engine_args = EngineArgs.from_kwargs(**engine_kwargs)
    names = args.served_model_name or [args.model or Path(DEFAULT_MODEL_FILE).stem]
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    taken = [name for name, _ in lora_modules if name in names]
    if taken:
        raise ValueError(f"--lora-modules: {taken} are also base model names (--served-model-name)")
    lora_requests = [LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(lora_modules)]
    request_log = RequestLog(args.request_log) if getattr(args, "request_log", None) else None
    # Built on the engine thread, the one that steps it (AsyncLLMEngine: one OpenMP team).
    async_engine = AsyncLLMEngine(lambda: build_engine(engine_args, args.engine_factory, lora_requests), None,
                                  args.max_waiting_requests, args.request_timeout, request_log)
    async_engine.metrics = EngineMetrics(names[0], async_engine.model_info.max_model_len,
                                         engine_args.max_num_seqs, engine_args.max_num_batched_tokens,
                                         model_info=async_engine.model_info)
    app = build_app(async_engine, names, api_key, model_root=str(args.model or DEFAULT_MODEL_FILE),
                    api_keys=api_keys, max_queue_wait=args.max_queue_wait,
                    enable_dashboard=not args.disable_dashboard,
                    max_request_body_bytes=args.max_request_body_bytes, lora_requests=lora_requests,
                    allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False))
    # asyncio and h11, never uvloop and httptools: uvicorn's "auto" takes those when installed
    # (ray[serve] brings both), and the server's behaviour must not depend on what else is installed.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=5, loop="asyncio", http="h11")
    server = DrainingServer(config, async_engine, args.drain_timeout)
    async_engine.start()
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0
