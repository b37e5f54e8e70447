"""Small helpers with no home of their own: no engine state, no torch."""

from __future__ import annotations

import inspect
import socket
from typing import Any, Optional


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: the blocks of ``b`` tokens that ``a`` tokens fill."""
    return -(-a // b)


def check_utf8(text: str, what: str = "prompt") -> None:
    """Raises: ValueError naming the first character with no UTF-8 encoding (a lone surrogate
    such as ``"\\ud800"``, which JSON can carry but no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 text: character {exc.start} is the lone "
                         f"surrogate {text[exc.start]!r}") from None


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it: a server checks its address before seconds of
    model loading, not after.

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


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles, as the server takes them


def template_message(index: int, message: Any) -> dict[str, Any]:
    """Chat message ``index`` of ``LLM.chat`` as a chat template takes it, checked as the server
    checks its messages (``protocol.ChatMessage``): a role among ``CHAT_ROLES``; ``content`` text
    or a list of ``{"type": "text", "text"}`` parts (joined by newlines, as vLLM joins them),
    required except in an assistant message (which may carry only tool calls; then ""); ``name``
    and ``tool_call_id`` strings and ``tool_calls`` a list where given.

    Raises:
        ValueError: naming the message and what is wrong with it.
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {index} must be a dict with a string 'role', got {message!r}")
    role, content = message["role"], message.get("content")
    if role not in CHAT_ROLES:
        raise ValueError(f"message {index} has role {role!r}; the roles are {list(CHAT_ROLES)} "
                         "(as the server takes them)")
    if content is None and role != "assistant":
        raise ValueError(f"message {index}: a {role!r} message needs 'content'")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise ValueError(f"message {index}: content parts must be {{'type': 'text', 'text': str}} "
                             f"(this engine reads text only), got {content!r}")
        content = "\n".join(part["text"] for part in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"message {index}: content must be a string or a list of text parts, got {content!r}")
    for key, kind, name in (("name", str, "a string"), ("tool_call_id", str, "a string"), ("tool_calls", list, "a list")):
        if message.get(key) is not None and not isinstance(message[key], kind):
            raise ValueError(f"message {index}: {key} must be {name}, got {message[key]!r}")
    return {**message, "content": content or ""}


def check_chat_template_kwargs(tokenizer: Any, kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The chat template's own variables (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``) as keyword arguments for ``tokenizer.apply_chat_template``.

    Raises:
        ValueError: a key that is one of ``apply_chat_template``'s parameters (``tokenize``,
            ``tools``, ``chat_template``, ...): those have fields of their own or are not for
            requests to set.
    """
    if not kwargs:
        return {}
    reserved = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    taken = sorted(set(kwargs) & reserved)
    if taken:
        raise ValueError(f"chat_template_kwargs may only hold the template's own variables; {taken} are "
                         f"apply_chat_template's parameters")
    return dict(kwargs)

