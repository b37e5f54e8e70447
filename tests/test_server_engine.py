"""Server behaviour that needs the engine at hand: load shedding, request timeout, a dying
engine loop, duplicate ids, hostile inputs. uvicorn runs in a thread of this process over the
tiny random llama of conftest (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_engine, run_to_completion
from tests.test_server import MODEL, InThreadServer, idle, scrape, sse_events, wait_for_metrics

ABORT = 'pagedllm:request_success_total{finished_reason="abort"}'


def slowed(engine, seconds: float):
    """Make every engine step take at least ``seconds``, so that requests stay in flight."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    engine.step = slow_step
    return engine


def openai_client(server: InThreadServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_full_waiting_queue_answers_429_with_retry_after():
    engine = slowed(make_tiny_engine(max_num_seqs=1), 0.03)  # the running request lasts >= 3.6 s
    with InThreadServer(engine, max_waiting_requests=2) as server:
        client = openai_client(server)
        body = dict(model=MODEL, max_tokens=120, stream=True)
        running = client.completions.create(prompt=[1, 2, 3], **body)
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 1)
        waiting = [client.completions.create(prompt=[4, 5, 6], **body) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(prompt=[7, 8, 9], **body)
        assert info.value.response.headers["Retry-After"] == "1"
        assert "max_waiting_requests is 2" in info.value.body["message"]
        for stream in [running, *waiting]:
            stream.close()
        wait_for_metrics(server.url, lambda v: idle(v) and v[ABORT] == 3)
        assert client.completions.create(model=MODEL, prompt=[1], max_tokens=2).usage.completion_tokens == 2


def test_request_timeout_aborts_and_frees_blocks():
    engine = slowed(make_tiny_engine(), 0.03)
    with InThreadServer(engine, request_timeout=0.5) as server:
        started = time.monotonic()
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 120}, timeout=30)
        assert response.status_code == 504
        assert "request timeout of 0.5 s" in response.json()["error"]["message"]
        assert time.monotonic() - started < 120 * 0.03  # aborted long before it could finish
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": [1, 2, 3], "max_tokens": 120, "stream": True}) as stream:
            events = sse_events(stream.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
        assert all(choice["finish_reason"] is None for event in events[:-2] for choice in event["choices"])
        wait_for_metrics(server.url, lambda v: idle(v) and v[ABORT] == 2)


def test_dead_engine_loop_makes_health_503_and_requests_fail_fast():
    engine = make_tiny_engine()
    step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return step()
    engine.step = failing_step
    with InThreadServer(engine) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": [1, 2, 3], "max_tokens": 50, "stream": True}) as stream:
            events = sse_events(stream.iter_lines())
        assert events[-2]["error"]["code"] == 503 and "injected fault" in events[-2]["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
        started = time.monotonic()
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 5}, timeout=30)
        assert response.status_code == 503
        assert time.monotonic() - started < 5
        values = scrape(server.url)
        assert values["pagedllm:engine_healthy"] == 0
        assert values['pagedllm:request_success_total{finished_reason="error"}'] == 1
        assert idle(values)


def test_duplicate_in_flight_request_id_is_refused_and_corrupts_nothing():
    expected_engine = make_tiny_engine()
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected_engine.add_request("x", [5, 6, 7], params)
    expected = run_to_completion(expected_engine)["x"].outputs[0].token_ids
    engine = AsyncLLMEngine(slowed(make_tiny_engine(), 0.005))
    engine.start()

    async def run():
        stream = await engine.add_request("x", [5, 6, 7], params)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.add_request("x", [9, 9, 9], params)
        outputs = [output async for output in stream]
        again = await engine.add_request("x", [5, 6, 7], params)  # finished ids may be reused
        return outputs[-1], [output async for output in again][-1]

    try:
        first, second = asyncio.run(run())
    finally:
        engine.shutdown()
    assert first.outputs[0].token_ids == expected and second.outputs[0].token_ids == expected
    assert engine.engine.kv_cache_manager.usage == 0


@pytest.mark.parametrize("body", [
    {"prompt": [[]]}, {"prompt": [-1]}, {"prompt": [10**12]}, {"prompt": {"a": 1}}, {"prompt": "text"},
    {"prompt": [1], "n": 0}, {"prompt": [1], "top_p": 0}, {"prompt": [1], "temperature": "hot"},
    {"prompt": [1], "logit_bias": {"x": 1}}, {"prompt": [1], "stop_token_ids": [-5]},
    {"prompt": [1], "seed": 2**70}, {"prompt": [1], "logprobs": 1000}, {"prompt": [1], "max_tokens": 10**9},
    {"prompt": [1], "allowed_token_ids": []}, {"prompt": [1], "stream_options": "x"},
    {"prompt": [1], "suffix": "tail"}, {"prompt": [1], "best_of": 3}, {"prompt": [1], "cache_salt": ""},
    {"messages": []}, {"messages": [{"role": "user", "content": "needs a tokenizer"}]},
])
def test_hostile_inputs_are_400_and_never_kill_the_engine(tiny_server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(tiny_server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=30)
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_b11_max_tokens_null_means_rest_of_context(tiny_server):
    response = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3, 4, 5], "max_tokens": None, "temperature": 0})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 128 - 5  # make_tiny_engine: max_model_len 128


@pytest.fixture(scope="module")
def tiny_server():
    with InThreadServer(make_tiny_engine()) as server:
        yield server
