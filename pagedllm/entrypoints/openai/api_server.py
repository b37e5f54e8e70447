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

import asyncio
import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.version import __version__
from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.protocol import EngineClient
from pagedllm.engine.request_log import RequestLog
from pagedllm.entrypoints.openai.api_keys import DEFAULT_KEY_NAME, APIKey, KeyRing, RateLimiter
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from pagedllm.entrypoints.openai.errors import OpenAIError, error_type, to_openai_error
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import RequestRegistry, ServerPolicy, SSEResponse, client_context
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics import APIKeyMetrics, EngineMetrics
from pagedllm.utils import check_port_free

logger = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/debug")
_DASHBOARD_HTML = Path(__file__).with_name("dashboard.html")
_REQUEST_ID = re.compile(r"[\x21-\x2e\x30-\x7e]{1,128}")  # printable ASCII but "/": ids are path segments

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
        if cause.encoding.lower().replace("-", "") != "utf8":
            # json.loads picks UTF-16/32 from a byte-order mark or zero bytes at the start.
            return (f"the request body is not valid JSON: it must be UTF-8, and its first bytes made it read as "
                    f"{cause.encoding}")
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
                                    f"{self.max_body_bytes} bytes (--max-request-body-bytes)", error_type(413))

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


# The routes: module-level functions on routers, reading what ``build_app`` put in
# ``app.state`` (vLLM's ``api_server.py`` does the same), so one app's objects never leak into
# another's and each route can be read on its own.
router = APIRouter()
lora_router = APIRouter()  # with --allow-runtime-lora-updating
dashboard_router = APIRouter()  # without --disable-dashboard


def engine_client(raw_request: Request) -> EngineClient:
    """The engine the app serves (``build_app``'s ``engine``)."""
    return raw_request.app.state.engine_client


def models(raw_request: Request) -> OpenAIServingModels:
    """The served names and LoRA adapters, shared by the handlers."""
    return raw_request.app.state.openai_serving_models


def completions(raw_request: Request) -> OpenAIServingCompletion:
    """The ``/v1/completions`` handler (also tokenization for ``/tokenize``)."""
    return raw_request.app.state.openai_serving_completion


def chat(raw_request: Request) -> OpenAIServingChat:
    """The ``/v1/chat/completions`` handler (also chat rendering for ``/tokenize``)."""
    return raw_request.app.state.openai_serving_chat


def _dead(engine: EngineClient) -> OpenAIError:
    return OpenAIError(503, f"the engine loop is dead: {engine.dead_error!r}", "ServiceUnavailableError")


def _probe(raw_request: Request, ready: bool) -> Optional[Response]:
    """The 503 of a probe: the engine loop died, or (``ready``) the server is draining; None
    when it passes."""
    engine = engine_client(raw_request)
    if not engine.is_healthy:
        return _dead(engine).response()
    if ready and engine.draining:
        return OpenAIError(503, "the server is shutting down", "ServiceUnavailableError").response()
    return None


@router.get("/health")
async def health(raw_request: Request) -> Response:
    return _probe(raw_request, ready=True) or Response(status_code=200)


@router.get("/livez")
async def livez(raw_request: Request) -> Response:
    return _probe(raw_request, ready=False) or JSONResponse({"status": "alive"})


@router.get("/readyz")
async def readyz(raw_request: Request) -> Response:
    return _probe(raw_request, ready=True) or JSONResponse({"status": "ready"})


@router.get("/load")
async def load(raw_request: Request) -> dict:
    """The engine thread's newest snapshots (``SchedulerStats``, ``LoadStats``): the same
    counts as the ``/metrics`` gauges. Behind Ray Serve, those of the replica a new request
    would start soonest on, and under ``replicas`` each replica's last report (its prefix
    keys counted, not listed)."""
    engine = engine_client(raw_request)
    model_info = engine.model_info
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


@router.post("/v1/requests/{request_id}/cancel")
async def cancel(raw_request: Request, request_id: str = PathParam(
        min_length=1, max_length=160, pattern=r"^[\x21-\x7e]+$",
        description="an X-Request-Id or a response id (cmpl-..., chatcmpl-...)")) -> dict:
    """Abort the caller's open requests known by ``request_id`` (their ``X-Request-Id`` or
    response ``id``); their clients get what was generated, finish reason ``abort``.
    Another key's request is not found (404), as a finished one."""
    context = client_context(raw_request)
    cancelled = raw_request.app.state.request_registry.cancel(context.key_name, request_id)
    if not cancelled:
        raise OpenAIError(404, f"no open request {request_id!r} of this API key", "NotFoundError")
    logger.info("cancelled %d request(s) %r of key %s", cancelled, request_id, context.key_name)
    return {"id": request_id, "object": "request.cancelled", "cancelled": cancelled}


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/v1/models")
async def list_models(raw_request: Request) -> dict:
    return {"object": "list",
            "data": models(raw_request).list_models(raw_request.app.state.created, client_context(raw_request).key)}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> dict:
    """OpenAI's retrieve-model: the ``/v1/models`` entry whose id is ``model_id`` (ids may hold
    slashes), 404 if this API key sees none."""
    for entry in models(raw_request).list_models(raw_request.app.state.created, client_context(raw_request).key):
        if entry["id"] == model_id:
            return entry
    raise OpenAIError(404, f"The model {model_id!r} does not exist", "NotFoundError", param="model")


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    engine_metrics = engine_client(raw_request).metrics
    if engine_metrics is None:
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(engine_metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await completions(raw_request).create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await chat(raw_request).create_chat_completion(request, raw_request)


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> dict:
    serving = completions(raw_request)
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError(400, "give exactly one of prompt or messages")
    if request.messages is not None:
        _, tokens = await asyncio.to_thread(chat(raw_request).render, request.messages,
                                            request.add_generation_prompt, False, None, request.chat_template,
                                            request.chat_template_kwargs)
    else:
        tokens = await asyncio.to_thread(serving.encode_text, request.prompt, "prompt",
                                         add_special_tokens=request.add_special_tokens)
    return {"count": len(tokens), "max_model_len": engine_client(raw_request).model_info.max_model_len,
            "tokens": tokens}


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> dict:
    serving = completions(raw_request)
    serving.check_model(request.model)
    tokenizer = serving.require_tokenizer("detokenize")
    vocab_size = engine_client(raw_request).model_info.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(request.tokens)}


def _check_may_update_loras(raw_request: Request) -> None:
    """Raises: OpenAIError 403 for a key limited to some adapters (``lora_adapters``)."""
    key = client_context(raw_request).key
    if key is not None and key.lora_adapters is not None:
        raise OpenAIError(403, f"API key {key.name!r} is limited to some LoRA adapters and may not load or unload "
                               "adapters", "PermissionDeniedError")


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    _check_may_update_loras(raw_request)
    return PlainTextResponse(await models(raw_request).load_lora_adapter(request.lora_name, request.lora_path,
                                                                         request.load_inplace))


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    _check_may_update_loras(raw_request)
    return PlainTextResponse(await models(raw_request).unload_lora_adapter(request.lora_name))


# The live block-pool view: ``KVCacheSnapshot``s taken on the engine thread, as JSON
# (``/debug/kv``), as a server-sent event per new snapshot (``/debug/kv/stream``, a few per
# second while the engine steps) and drawn by a page (``/dashboard``). Only a local
# ``AsyncLLMEngine`` has a block pool at hand.
@dashboard_router.get("/debug/kv")
async def debug_kv(raw_request: Request) -> Response:
    try:
        snapshot = await engine_client(raw_request).get_kv_snapshot()
    except Exception as exc:
        raise to_openai_error(exc) from None
    return Response(snapshot.json, media_type="application/json")


@dashboard_router.get("/debug/kv/stream", include_in_schema=False)  # endless: not for schema fuzzers
async def debug_kv_stream(raw_request: Request) -> Response:
    engine = engine_client(raw_request)
    if not engine.is_healthy:
        raise _dead(engine)
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


@dashboard_router.get("/dashboard", include_in_schema=False)
async def dashboard(raw_request: Request) -> HTMLResponse:
    return HTMLResponse(raw_request.app.state.dashboard_page, headers={"Cache-Control": "no-cache"})


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _validation_error(exc).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
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
    return OpenAIError(status, message, error_type(status), headers=exc.headers).response()


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return to_openai_error(exc).response()


def build_app(engine: EngineClient, server_args: ServerArgs, api_keys: Optional[Sequence[APIKey]] = None,
              model_root: Optional[str] = None, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The FastAPI application over a started engine: an ``AsyncLLMEngine`` (``pagedllm
    serve``), or Ray Serve replicas through a ``RayEngineClient`` (``pagedllm serve --replicas``).

    Args:
        engine: the engine (its ``metrics``, if any, are served at /metrics, with the per-key
            series added).
        server_args: the server's options. Read here: ``served_model_name`` (default: the
            engine's ``model`` option, ``ServerArgs.served_model_names``), ``max_queue_wait``
            (overload protection's limit on a new request's estimated wait; None: only the
            engine's ``request_timeout``), ``max_request_body_bytes`` (413 beyond),
            ``disable_dashboard`` (else ``/debug/kv``, ``/debug/kv/stream`` and
            ``/dashboard``, which need an ``AsyncLLMEngine``), ``lora_modules`` (adapters the
            engine has loaded, ids 1, 2, ...: ``ServerArgs.lora_requests``) and
            ``allow_runtime_lora_updating`` (else ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` are 404).
        api_keys: every key, with names and limits (``api_keys.py``), already loaded (default:
            ``server_args.load_api_keys()``). With none the API is open and every caller is
            ``anonymous``.
        model_root: what /v1/models reports as ``root`` (default: the first served name).
        clock: the rate limiter's monotonic clock, seconds (tests pass a fake one).

    Raises:
        ValueError: bad ``server_args`` (``ServerArgs.verify``), a dashboard asked of another
            engine client, a key name used twice, a key with a priority under the ``fcfs``
            scheduling policy.
    """
    server_args.verify()
    model_info = engine.model_info  # the event loop reads nothing of the LLMEngine itself
    served_model_names = server_args.served_model_names(model_info.model)
    if not server_args.disable_dashboard and not isinstance(engine, AsyncLLMEngine):
        raise ValueError(f"the dashboard reads a local engine's block pool; {type(engine).__name__} has none: "
                         "pass disable_dashboard=True")
    keys = list(server_args.load_api_keys() if api_keys is None else api_keys)
    names = [key.name for key in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"API key names must be unique, got {names} (--api-key's key is named "
                         f"{DEFAULT_KEY_NAME!r})")
    with_priority = [key.name for key in keys if key.priority not in (None, 0)]
    if with_priority and model_info.scheduling_policy != "priority":
        raise ValueError(f"API keys {with_priority} set a priority, which needs --scheduling-policy priority "
                         f"(the engine schedules {model_info.scheduling_policy!r})")
    app = FastAPI(title="pagedllm", version=__version__)
    key_metrics = None
    if engine.metrics is not None:
        key_metrics = APIKeyMetrics(engine.metrics.registry, engine.metrics.model_name, names)
    limiter = RateLimiter(keys, clock, key_metrics.record if key_metrics is not None else None)
    policy = ServerPolicy(limiter, RequestRegistry(), server_args.max_queue_wait)
    if key_metrics is not None:
        policy.record = key_metrics.record
    serving_models = OpenAIServingModels(engine, served_model_names, model_root or served_model_names[0],
                                         server_args.lora_requests())
    state = app.state
    state.engine_client = engine
    state.request_registry = policy.registry
    state.openai_serving_models = serving_models
    state.openai_serving_completion = OpenAIServingCompletion(engine, served_model_names, policy, serving_models)
    state.openai_serving_chat = OpenAIServingChat(engine, served_model_names, policy, serving_models)
    state.created = int(time.time())
    app.add_middleware(_ClientMiddleware, keyring=KeyRing(keys), limiter=limiter,
                       max_body_bytes=server_args.max_request_body_bytes)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    if server_args.allow_runtime_lora_updating:
        app.include_router(lora_router)
    if not server_args.disable_dashboard:
        state.dashboard_page = _DASHBOARD_HTML.read_text(encoding="utf-8")
        app.include_router(dashboard_router)
    return app


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


EngineFactory = Callable[[EngineArgs], LLMEngine]


def build_engine(engine_args: EngineArgs, engine_factory: Optional[EngineFactory] = None,
                 lora_requests: Sequence[LoRARequest] = ()) -> LLMEngine:
    """``engine_factory(engine_args)`` (default ``LLMEngine``: tests pass one that builds a
    tiny model) with ``lora_requests`` loaded.

    Raises:
        ValueError: as ``LLMEngine``, or an adapter it refuses (``LLMEngine.add_lora``).
    """
    engine = (engine_factory or LLMEngine)(engine_args)
    for lora_request in lora_requests:
        engine.add_lora(lora_request)
    return engine


def run_server(server_args: ServerArgs, engine_args: EngineArgs, engine_factory: Optional[EngineFactory] = None) -> int:
    """Build the engine, serve until a signal, drain, return 0.

    Args:
        engine_factory: builds the engine from ``engine_args`` (default ``LLMEngine``; tests
            serve tiny random models through it).

    Raises:
        ValueError: bad options (``ServerArgs.verify``, the keys file), the port cannot be
            bound, or a configuration that cannot run.
    """
    server_args.verify(engine_args)
    api_keys = server_args.load_api_keys()
    check_port_free(server_args.host, server_args.port)  # before seconds of model loading, not after
    lora_requests = server_args.lora_requests()
    request_log = RequestLog(server_args.request_log) if server_args.request_log else None
    # Built on the engine thread, the one that steps it (AsyncLLMEngine: one OpenMP team).
    async_engine = AsyncLLMEngine(lambda: build_engine(engine_args, engine_factory, lora_requests), None,
                                  server_args.max_waiting_requests, server_args.request_timeout, request_log)
    names = server_args.served_model_names(engine_args.model)
    async_engine.metrics = EngineMetrics(names[0], async_engine.model_info.max_model_len,
                                         engine_args.max_num_seqs, engine_args.max_num_batched_tokens,
                                         model_info=async_engine.model_info)
    app = build_app(async_engine, server_args, api_keys, model_root=ServerArgs.model_root(engine_args.model))
    # asyncio and h11, never uvloop and httptools: uvicorn's "auto" takes those when installed
    # (ray[serve] brings both), and the server's behaviour must not depend on what else is
    # installed. uvicorn logs at the level `pagedllm --log-level` gave the root logger.
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=5, loop="asyncio", http="h11")
    server = DrainingServer(config, async_engine, server_args.drain_timeout)
    async_engine.start()
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0
