"""OpenAI ``tools`` on /v1/chat/completions, with the official client: ``required`` and a
named function are enforced by a JSON-schema constraint (so the arguments parse and validate
even from a random-weight model), ``auto`` parses Qwen's ``<tool_call>`` blocks, and streamed
tool-call deltas join to the non-streamed arguments."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.tool_calls import held_back, parse_auto, parse_forced
from pagedllm.models.registry import NAMED_MODELS
from tests.test_structured_outputs import make_engine, pytestmark  # noqa: F401 - same skip

WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "required": ["timezone"], "additionalProperties": False,
        "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    from tests.test_server import InThreadServer
    with InThreadServer(make_engine(), served_model_name="tiny") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kwargs):
    kwargs.setdefault("max_tokens", 300)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, **kwargs)


def streamed_calls(stream) -> tuple[dict[int, dict], str]:
    """Tool calls joined from OpenAI deltas: index -> {id, name, arguments}; and the finish."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_validate_and_stream_the_same(client, tool_choice):
    response = create(client, tool_choice=tool_choice)
    choice = response.choices[0]
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a named function
    else:
        assert choice.finish_reason == "tool_calls"
    calls, finish = streamed_calls(create(client, tool_choice=tool_choice, stream=True))
    assert finish == choice.finish_reason
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(call["id"] for call in calls.values())


def test_named_call_cut_by_max_tokens_keeps_its_call_as_streamed(client):
    """Found by the fresh-user check: cut short, the non-streamed reply lost its tool call while
    the stream had sent it; both now carry the arguments generated so far (as vLLM)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = create(client, tool_choice=named, max_tokens=3).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and call.function.arguments
    calls, finish = streamed_calls(create(client, tool_choice=named, max_tokens=3, stream=True))
    assert finish == "length"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]


def streamed_pieces(stream) -> dict[int, list[str]]:
    """Per call index, the non-empty ``arguments`` pieces of the deltas, in order."""
    pieces: dict[int, list[str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function is not None and delta.function.arguments:
                    pieces.setdefault(delta.index, []).append(delta.function.arguments)
    return pieces


def test_required_calls_stream_piece_by_piece_and_cut_short_keep_their_calls(client):
    """Found by the fresh-user check: ``required`` sent each call whole when the reply ended,
    and a reply cut by ``max_tokens`` came back as ``content`` holding pagedllm's own partial
    JSON. Now its calls stream as they are generated (as a named function's), and a reply cut
    at any length has no content and each call whose name was generated, its arguments a
    prefix of the whole reply's (greedy), the same streamed or not."""
    whole = create(client, tool_choice="required").choices[0].message.tool_calls
    pieces = streamed_pieces(create(client, tool_choice="required", stream=True))
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [c.function.arguments for c in whole]
    assert max(len(p) for p in pieces.values()) > 1
    cut_calls = 0
    for max_tokens in (1, 3, 6, 10, 15):
        choice = create(client, tool_choice="required", max_tokens=max_tokens).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        calls = choice.message.tool_calls or []
        cut_calls += len(calls)
        assert len(calls) <= len(whole)
        for call, full in zip(calls, whole):
            assert call.function.name == full.function.name
            assert full.function.arguments.startswith(call.function.arguments)
        streamed, finish = streamed_calls(create(client, tool_choice="required", max_tokens=max_tokens, stream=True))
        assert finish == "length"
        assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)] == \
            [(c.function.name, c.function.arguments) for c in calls]
    assert cut_calls  # some cut came after a call's name


def test_parallel_tool_calls_false_gives_one_call_per_choice(client):
    """Found by the fresh-user check: ``parallel_tool_calls: false`` was accepted and ignored.
    Sampled ``required`` replies hold several calls unless it is false (the array is then
    constrained to one item), streamed or not; an ``auto`` reply keeps its first call."""
    def counts(**kwargs) -> list[int]:
        response = create(client, tool_choice="required", temperature=1.0, seed=0, n=8, max_tokens=60, **kwargs)
        return [len(choice.message.tool_calls or []) for choice in response.choices]
    assert max(counts()) > 1
    assert counts(parallel_tool_calls=False) == [1] * 8
    calls, finish = streamed_calls(create(client, tool_choice="required", temperature=1.0, seed=1,
                                          parallel_tool_calls=False, stream=True))
    assert len(calls) == 1 and finish == "tool_calls"
    block = r'<tool_call>\n\{"name": "get_time", "arguments": \{"timezone": "(UTC|CET)"\}\}\n</tool_call>'
    two = {"guided_regex": block + "\n" + block}
    assert len(create(client, tool_choice="auto", extra_body=two).choices[0].message.tool_calls) == 2
    for stream in (False, True):
        response = create(client, tool_choice="auto", extra_body=two, parallel_tool_calls=False, stream=stream)
        if stream:
            calls, finish = streamed_calls(response)
            assert len(calls) == 1 and calls[0]["name"] == "get_time" and finish == "tool_calls"
        else:
            (call,) = response.choices[0].message.tool_calls
            assert call.function.name == "get_time" and response.choices[0].finish_reason == "tool_calls"


def test_parse_forced_required_at_every_cut():
    """Every prefix of a ``required`` reply (any JSON spacing) parses to the calls whose names
    are complete, each one's arguments a prefix of its final text; the whole reply to every
    call with its ``parameters`` text."""
    for text in ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "parameters": {"timezone": "UTC"}}]',
                 '[ { "name" : "f" , "parameters" : { } } ,{"parameters":{"x":[1,{"y":"}"}]},"name":"g"}]'):
        final = parse_forced(text, "required", None)
        assert [(c.name, json.loads(c.arguments)) for c in final] == \
            [(c["name"], c["parameters"]) for c in json.loads(text)]
        seen = 0
        for cut in range(len(text) + 1):
            calls = parse_forced(text[:cut], "required", None)
            assert seen <= len(calls) <= len(final)
            seen = len(calls)
            for call, full in zip(calls, final):
                assert call.name == full.name and full.arguments.startswith(call.arguments), (cut, call)


def test_auto_parses_tool_call_blocks_from_the_reply(client):
    """A regex makes the random model write one Hermes/Qwen ``<tool_call>`` block after some
    text; ``auto`` turns it into ``tool_calls`` and keeps the text before it as content."""
    regex = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", ' \
            r'"unit": "celsius"\}\}\n</tool_call>'
    response = create(client, tool_choice="auto", extra_body={"guided_regex": regex})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] == "celsius" and arguments["city"] in ("Paris", "Rome")
    stream = create(client, tool_choice="auto", extra_body={"guided_regex": regex}, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                calls[delta.index] = (delta.function.name, delta.function.arguments)
    assert content == "Let me check.\n" and finish == "tool_calls"
    assert calls == {0: ("get_weather", call.function.arguments)}


def test_parse_auto_and_held_back():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_auto(text)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_auto("no call here") == ("no call here", [])
    assert parse_auto("<tool_call>not json</tool_call>")[1] == []
    assert [held_back(t) for t in ("abc", "abc<", "abc<tool_", "<tool_call", "a<b")] == [0, 1, 6, 10, 0]


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}]}, "tools", "tools entry 0 must be"),
    # Under the default tool_choice ("auto") too: the model may call any tool it is shown.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools",
     "tools entry 0: parameters is not a JSON schema that compiles: Invalid type: bogus"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", f"function name {TOOLS[0]['function']['name']!r} is already taken"),
    ({"messages": MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not JSON"),
    ({"tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrains the reply already"),
])
def test_bad_tool_requests_are_400s(client, body, param, words):
    import httpx
    payload = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **body}
    response = httpx.post(str(client.base_url).rstrip("/") + "/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param


@pytest.mark.slow
@pytest.mark.skipif(not NAMED_MODELS["qwen2.5-coder-0.5b"].is_installed(), reason="needs Qwen2.5-Coder")
def test_qwen_template_receives_the_tools_and_forced_calls_validate():
    from pagedllm import LLM
    from tests.test_server import InThreadServer

    llm = LLM(model="qwen2.5-coder-0.5b", dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    with_tools, without = (tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                                                          add_generation_prompt=True),
                                            add_special_tokens=False) for tools in (TOOLS, None))
    with InThreadServer(llm.llm_engine, served_model_name="tiny") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        named = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60)
        plain = create(client, tool_choice="none", max_tokens=1)
    assert named.usage.prompt_tokens == len(with_tools) and plain.usage.prompt_tokens == len(without)
    (call,) = named.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Paris"
