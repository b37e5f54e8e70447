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
