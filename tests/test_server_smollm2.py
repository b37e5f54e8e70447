"""The server over the real SmolLM2 (text matters): chat replies equal the offline ``LLM.chat``
greedy replies, and a streamed n=2 chat that ends naturally follows the OpenAI protocol (B30)."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedllm.sampling_params import SamplingParams
from tests.test_server import InThreadServer, check_stream_protocol, sse_events

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]


@pytest.fixture(scope="module")
def reference_and_server(smollm2_llm_fp32):
    """The offline greedy reply first (the engine thread owns the engine while serving)."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    reference = smollm2_llm_fp32.chat(CAPITAL, params, use_tqdm=False)[0].outputs[0]
    with InThreadServer(smollm2_llm_fp32.llm_engine, served_model_name="smollm2") as server:
        yield reference, server


def test_chat_equals_offline_greedy(reference_and_server):
    expected, server = reference_and_server
    assert expected.finish_reason == "stop"  # the reply ends by itself within 40 tokens
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=40)
    assert response.choices[0].message.content == expected.text
    assert "Paris" in expected.text
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model="smollm2", messages=CAPITAL, temperature=0, max_tokens=40,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected.text


def test_b30_streamed_n2_chat_ending_naturally(reference_and_server):
    expected, server = reference_and_server
    body = {"model": "smollm2", "messages": CAPITAL, "n": 2, "temperature": 0, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        events = sse_events(response.iter_lines())
    finish, texts, usage = check_stream_protocol(events, n=2, chat=True)
    assert finish == {0: "stop", 1: "stop"}
    assert texts == {0: expected.text, 1: expected.text}
    assert usage["completion_tokens"] == 2 * len(expected.token_ids)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(reference_and_server):
    """vLLM's ``stream_options.continuous_usage_stats`` (a new user found it accepted and
    ignored): every chat chunk carries the prompt's tokens and the completion's so far, the role
    chunk none of the completion's yet, and the last usage chunk the totals."""
    expected, server = reference_and_server
    body = {"model": "smollm2", "messages": CAPITAL, "temperature": 0, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected.token_ids)
    assert chunks[0]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                  "total_tokens": prompt_tokens}
    so_far = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert so_far == sorted(so_far) and 0 < so_far[1] and so_far[-2] == len(expected.token_ids)
    assert all(chunk["usage"]["total_tokens"] == prompt_tokens + chunk["usage"]["completion_tokens"]
               for chunk in chunks)


def test_chat_echo_template_kwargs_and_refused_template(reference_and_server):
    """vLLM's chat fields a new user found ignored: ``echo`` puts a continued assistant message
    before the reply (streamed as its own chunk after the role's), not a user's;
    ``chat_template_kwargs`` reach the template (a variable SmolLM2's ignores changes nothing)
    and may not name ``apply_chat_template``'s parameters; a request's own ``chat_template`` is
    refused with a 400, as vLLM refuses it without --trust-request-chat-template."""
    _, server = reference_and_server
    partial = CAPITAL + [{"role": "assistant", "content": "The capital of France is"}]
    body = {"model": "smollm2", "messages": partial, "temperature": 0, "max_tokens": 8,
            "add_generation_prompt": False, "continue_final_message": True}
    url = server.url + "/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=120).json()["choices"][0]["message"]["content"]
    assert plain and echoed == "The capital of France is" + plain
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}, timeout=120) as response:
        events = sse_events(response.iter_lines())
    deltas = [event["choices"][0]["delta"] for event in events[:-1] if event["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "The capital of France is"}
    assert "".join(delta.get("content") or "" for delta in deltas) == echoed
    user_last = httpx.post(url, json={"model": "smollm2", "messages": CAPITAL, "temperature": 0, "max_tokens": 4,
                                      "echo": True}, timeout=120).json()["choices"][0]["message"]["content"]
    assert "What is the capital" not in user_last

    tokenize = server.url + "/tokenize"
    base = httpx.post(tokenize, json={"messages": CAPITAL}, timeout=60).json()["tokens"]
    kwargs = httpx.post(tokenize, json={"messages": CAPITAL, "chat_template_kwargs": {"enable_thinking": False}},
                        timeout=60).json()["tokens"]
    assert kwargs == base
    for path, extra in (("/v1/chat/completions", {"model": "smollm2", "max_tokens": 1}), ("/tokenize", {})):
        reserved = httpx.post(server.url + path, json={"messages": CAPITAL, "chat_template_kwargs": {"tokenize": True},
                                                       **extra}, timeout=60)
        assert reserved.status_code == 400
        assert reserved.json()["error"]["param"] == "chat_template_kwargs"
        assert "['tokenize']" in reserved.json()["error"]["message"]
        refused = httpx.post(server.url + path, json={"messages": CAPITAL, "chat_template": "{{ 'x' }}", **extra},
                             timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
