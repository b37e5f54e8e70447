"""OpenAI ``tools`` / ``tool_choice`` on chat completions (vLLM ``serving_chat.py`` and its
Hermes tool parser, ``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``).

- ``tool_choice="required"`` or a named function: the reply is constrained by a JSON schema
  built from the tools' ``parameters`` (a named function: its arguments object; required: a
  non-empty array of ``{"name", "parameters"}``, vLLM's ``_get_json_schema_from_tool``), so
  the calls always parse.
- ``"auto"``: the model decides; its ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks (the format of Qwen2.5's and Hermes' chat templates) become ``tool_calls``.
- ``"none"``: plain text, and the template does not see the tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.structured_output import check_json_schema

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_START = "<tool_call>"


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def as_openai(self, index: Optional[int] = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def check_tools(tools: Optional[list[Any]], tool_choice: Any) -> tuple[str, Optional[dict]]:
    """``(mode, named function or None)``, mode one of ``none``, ``auto``, ``required``,
    ``named``; OpenAI's default is ``auto`` with tools, ``none`` without.

    Raises:
        ValueError: a malformed tool (its ``parameters`` not a schema that compiles, a name
            two entries share) or ``tool_choice``, a named function not among the tools,
            or a ``tool_choice`` other than ``none`` without tools; the message starts with the
            field's name.
    """
    functions = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ValueError(f"tools entry {i} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"parameters\": ...}}}}, got {tool!r}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools entry {i}: parameters must be a JSON schema object")
        if "parameters" in function:  # checked whatever tool_choice is: "auto" may call it
            check_json_schema(function["parameters"], f"tools entry {i}: parameters")
        if function["name"] in functions:
            raise ValueError(f"tools entry {i}: function name {function['name']!r} is already taken by an "
                             "earlier entry (a call could not say which one it means)")
        functions[function["name"]] = function
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if tool_choice == "none":
        return "none", None
    if not functions:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice in ("auto", "required"):
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    if name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools {sorted(functions)}")
    return "named", functions[name]


def constraint_schema(tools: list[dict], mode: str, named: Optional[dict], parallel: bool = True) -> Optional[dict]:
    """The JSON schema that forces the reply into tool calls (None for ``auto``/``none``); not
    ``parallel`` (``parallel_tool_calls: false``), ``required``'s array holds one call."""
    if mode == "named":
        return named.get("parameters") or {"type": "object"}
    if mode != "required":
        return None
    variants = [{"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                 "properties": {"name": {"enum": [t["function"]["name"]]},
                                "parameters": t["function"].get("parameters") or {"type": "object"}}}
                for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": variants}}


_JSON = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def parse_forced(text: str, mode: str, named: Optional[dict]) -> list[ToolCall]:
    """The calls of a reply generated under ``constraint_schema``, whole or cut short (by
    ``max_tokens``, a stop string, or while it streams). A named function's call is always
    there, its arguments being the text. ``required``'s reply is a JSON array of ``{"name",
    "parameters"}`` objects: each call whose name is complete, its arguments the text of its
    ``parameters`` value as generated (cut short: the prefix so far). So a stream can send each
    call's arguments piece by piece, and the pieces join to the finished reply's arguments (an
    incomplete call's as OpenAI returns them: text that may not parse)."""
    if mode == "named":
        return [ToolCall(named["name"], text)]
    calls: list[ToolCall] = []
    pos = _SPACE.match(text).end()
    if not text.startswith("[", pos):
        return calls
    pos += 1
    while True:  # one call per turn, from just after "[" or ","
        pos = _SPACE.match(text, pos).end()
        if not text.startswith("{", pos):
            return calls  # "]" or not generated yet
        pos += 1
        name = arguments = None
        while True:  # one key per turn
            pos = _SPACE.match(text, pos).end()
            if text.startswith("}", pos):
                pos += 1
                break
            if text.startswith(",", pos):
                pos = _SPACE.match(text, pos + 1).end()
            try:
                key, pos = _JSON.raw_decode(text, pos)
                pos = _SPACE.match(text, pos).end()
                if not text.startswith(":", pos):
                    raise ValueError("cut before ':'")
                pos = _SPACE.match(text, pos + 1).end()
            except ValueError:
                key, pos = None, len(text)
            try:
                value, end = _JSON.raw_decode(text, pos)
            except ValueError:  # cut short inside this value
                if name is not None:
                    calls.append(ToolCall(name, text[pos:] if key == "parameters" else arguments or ""))
                return calls
            if key == "name":
                name = value
            elif key == "parameters":
                arguments = text[pos:end]
            pos = end
        calls.append(ToolCall(name, arguments or ""))
        pos = _SPACE.match(text, pos).end()
        if text.startswith(",", pos):
            pos += 1


def parse_auto(text: str) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` of a free reply: the text before the first ``<tool_call>`` (None
    when empty) and each well-formed ``<tool_call>`` block. Without one, the text is content."""
    if TOOL_CALL_START not in text:
        return text, []
    calls = []
    for block in TOOL_CALL_RE.findall(text):
        try:
            call = json.loads(block)
            calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            continue
    if not calls:
        return text, []
    content = text[:text.index(TOOL_CALL_START)].strip()
    return content or None, calls


def held_back(text: str) -> int:
    """How many trailing characters of streamed ``text`` might begin ``<tool_call>`` and must
    wait for the next delta."""
    for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return size
    return 0


def template_messages_arguments(message: dict, index: int) -> dict:
    """An assistant message's ``tool_calls`` with ``arguments`` as objects, which chat
    templates (Qwen2.5's) serialize with ``tojson`` (vLLM does the same).

    Raises:
        ValueError: an ``arguments`` string that is not JSON, naming
            ``messages[index].tool_calls[j].function.arguments`` (a template would otherwise
            get the bare string where every other call has an object).
    """
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        call = json.loads(json.dumps(call))
        function = call.get("function", {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError as exc:
                raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments is not JSON "
                                 f"({exc}): {function['arguments'][:80]!r}") from None
        calls.append(call)
    return {**message, "tool_calls": calls} if calls else message
