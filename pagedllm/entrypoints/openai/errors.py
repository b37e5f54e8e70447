"""OpenAI's error JSON, and the HTTP error of each engine exception.

Every error the server answers is an ``OpenAIError``: ``{"error": {"message", "type", "param",
"code"}}`` with vLLM's type names.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any, Optional

from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import (EngineDeadError, EngineDrainingError, QueueFullError,
                                          RequestFailedError, RequestTimeoutError)
from pagedllm.sampling_params import SamplingParams


# vLLM's error type names; other statuses get their phrase ("Payload Too Large" -> PayloadTooLargeError)
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 422: "BadRequestError",
                429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_type(status: int) -> str:
    """vLLM's type name of an HTTP ``status`` (``NotFoundError``), else its phrase's
    (``Payload Too Large`` -> ``PayloadTooLargeError``)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


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
    (``temperature must be >= 0, got -1``, ``logprobs=-1 asks for ...``), which becomes ``param``."""
    field = re.split(r"[ =]", str(exc), maxsplit=1)[0].rstrip(":")
    return OpenAIError(400, str(exc), param=field if field.isidentifier() else None)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote the request's text, and a lone
    surrogate in it (valid in JSON, not in UTF-8) must not break the error response itself."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def value_error(exc: ValueError) -> OpenAIError:
    """An engine ``ValueError`` (its message names the field and the value) as a 400, ``param``
    the request field its message starts with (``min_tokens=600 is more than ...``), if any."""
    field = re.split(r"[ =]", str(exc), maxsplit=1)[0]
    return OpenAIError(400, str(exc), param=field if field in SamplingParams.__dataclass_fields__ else None)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map an engine exception to its HTTP error (anything unexpected is a 500)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return value_error(exc)
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), "RateLimitError", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDrainingError):  # another instance behind the load balancer can take it
        return OpenAIError(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):  # a restart takes about a model load
        return OpenAIError(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "30"})
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, str(exc), "TimeoutError")
    if isinstance(exc, RequestFailedError):  # the engine ended the request and keeps serving
        return OpenAIError(500, str(exc), "InternalServerError")
    return OpenAIError(500, f"internal error: {exc!r}", "InternalServerError")
