"""Server behaviour that needs the engine at hand: load shedding, request timeout, a dying
engine loop, duplicate ids, hostile inputs. uvicorn runs in a thread of this process over the
tiny random llama of conftest (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, QueueFullError
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_engine, run_to_completion
from tests.test_server import (MODEL, InThreadServer, failing_at_step, idle, scrape, slowed, smollm2_tokenizer,
                               sse_events, tiny_chat_engine, wait_for_metrics)

ABORT = 'pagedllm:request_success_total{finished_reason="abort"}'


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


def gated(engine):
    """The engine and a ``threading.Event``: while the event is clear, the engine thread's next
    step waits for it, so that requests sent meanwhile wait for the engine to take them (its
    commands are taken between steps) and are then taken together, as a burst is."""
    gate = threading.Event()
    gate.set()
    step = engine.step

    def gated_step():
        gate.wait()
        return step()
    engine.step = gated_step
    return engine, gate


def hold_engine(server: InThreadServer, gate: threading.Event) -> None:
    """With one request running: clear the gate and wait until the engine thread waits at it."""
    gate.clear()
    iteration = scrape(server.url)["pagedllm:iteration_tokens_total_count"]
    time.sleep(0.3)  # a step already past the gate ends; the next one waits
    assert scrape(server.url)["pagedllm:iteration_tokens_total_count"] <= iteration + 1


def test_waiting_limit_counts_sequences_beyond_the_free_seats():
    """Found by a fresh user: ``--max-waiting-requests`` refused a burst on a server with free
    seats (max_num_seqs 4, limit 4: 4 of 8 refused). Requests the next step starts on free
    seats do not wait for capacity: with max_num_seqs 3, one running and a limit of 1, a burst
    taken in one go fills the 2 free seats and the one waiting place (an n=2 request counts
    2), and only the last is refused (QueueFullError, the server's 429)."""
    engine, gate = gated(make_tiny_engine(max_num_seqs=3))
    engine = AsyncLLMEngine(engine, max_waiting_requests=1)
    engine.start()
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def burst() -> list:
        running = await engine.add_request("running", [1, 2, 3], params)
        await running.__anext__()
        gate.clear()
        await asyncio.sleep(0.3)  # the step past the gate ends; the engine thread waits at the next
        # Queued together (the engine thread takes them in order between two steps).
        adds = [engine.add_request("pair", [4, 5], SamplingParams(n=2, max_tokens=100, ignore_eos=True))]
        adds += [engine.add_request(f"single-{i}", [6, i], params) for i in range(2)]
        tasks = [asyncio.ensure_future(add) for add in adds]
        await asyncio.sleep(0.3)
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for stream in [running, *results]:
            if not isinstance(stream, BaseException):
                stream.close()
        return results

    try:
        pair, first, second = asyncio.run(burst())
    finally:
        engine.shutdown()
    assert not isinstance(pair, BaseException) and not isinstance(first, BaseException)
    assert isinstance(second, QueueFullError)
    assert str(second) == ("1 sequences are waiting beyond the free seats of max_num_seqs and "
                           "max_waiting_requests is 1: retry later")


def test_cancel_finds_a_request_the_engine_has_not_taken_yet():
    """Found by a fresh user: ``POST /v1/requests/{id}/cancel`` answered 404 for a request
    sent during a long step (the engine takes new requests between steps), which then ran to
    its end. It is in the registry from its admission: the cancel answers 200 and the
    request ends with "abort" once the engine takes it."""
    engine, gate = gated(make_tiny_engine())
    with InThreadServer(engine) as server:
        client = openai_client(server)
        running = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=100, stream=True,
                                            extra_body=dict(ignore_eos=True))
        next(iter(running))
        hold_engine(server, gate)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            victim = pool.submit(httpx.post, server.url + "/v1/completions", headers={"X-Request-Id": "victim"},
                                 json={"prompt": [4, 5, 6], "max_tokens": 40}, timeout=30)
            time.sleep(0.5)
            cancelled = httpx.post(server.url + "/v1/requests/victim/cancel", timeout=10)
            gate.set()
            response = victim.result()
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] == 1
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "abort"
        assert response.json()["usage"]["completion_tokens"] < 40  # aborted within a step or two of being taken
        running.close()  # it may have run to its end meanwhile
        wait_for_metrics(server.url, lambda v: idle(v) and v[ABORT] >= 1)


def test_retrieve_model_by_id():
    """OpenAI's ``client.models.retrieve`` (found missing by a fresh user): the ``/v1/models``
    entry, whose id may hold slashes; an unknown id is a 404 naming it."""
    with InThreadServer(make_tiny_engine(), served_model_name="org/tiny-model") as server:
        client = openai_client(server)
        (listed,) = client.models.list().data
        assert client.models.retrieve("org/tiny-model") == listed
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("org/other")
        assert info.value.body == {"message": "The model 'org/other' does not exist", "type": "NotFoundError",
                                   "param": "model", "code": 404}


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
    engine = failing_at_step(make_tiny_engine(), 3)
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


@pytest.mark.parametrize("prompt", [[[1, 2], [3], []], [[1, 2], [3], [10**6]], [[1, 2], [3] * 200]])
def test_a_bad_prompt_in_a_list_refuses_the_request_before_any_prompt_starts(tiny_server, prompt):
    """Every prompt of a request is checked before the first reaches the engine: before, the
    good ones were admitted and computed, then aborted when a later one was refused."""
    before = scrape(tiny_server.url)
    response = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 50}, timeout=30)
    assert response.status_code == 400, response.text
    after = scrape(tiny_server.url)
    for name in (ABORT, "pagedllm:prompt_tokens_total", "pagedllm:num_requests_running", "pagedllm:num_requests_waiting"):
        assert after.get(name) == before.get(name), name


def test_use_beam_search_is_refused_not_silently_sampled(tiny_server, caplog):
    body = {"prompt": [1, 2], "max_tokens": 3, "n": 2, "use_beam_search": True}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search"
    with caplog.at_level("WARNING", logger="pagedllm.entrypoints.openai.serving_engine"):
        body.update(use_beam_search=False, chat_template="x")
        response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    assert "fields ignored in a request: chat_template, use_beam_search" in caplog.text


def test_b11_max_tokens_null_means_rest_of_context(tiny_server):
    response = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3, 4, 5], "max_tokens": None, "temperature": 0})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 128 - 5  # make_tiny_engine: max_model_len 128
    response = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3, 4, 5], "max_tokens": None, "min_tokens": 200})
    assert_openai_error(response, 400, "BadRequestError", "min_tokens=200 is more than the 123 tokens that "
                        "max_model_len=128 leaves after the 5-token prompt", param="min_tokens")
    # chat names the limit as the client sent it (a fresh user's report: max_tokens, never sent)
    response = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10,
                                "min_tokens": 600})
    assert_openai_error(response, 400, "BadRequestError", "min_tokens must be <= max_completion_tokens=10, got 600",
                        param="min_tokens")


def assert_openai_error(response: httpx.Response, status: int, type: str, message: str,
                        param=None) -> None:
    """``response`` is exactly OpenAI's error JSON (no ``detail`` anywhere) with these values."""
    assert response.status_code == status, response.text
    assert response.json() == {"error": {"message": message, "type": type, "param": param, "code": status}}


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("method, path, body, headers, status, type, message", [
    ("GET", "/v1/completions", None, None, 405, "MethodNotAllowedError",
     "method GET is not allowed on /v1/completions (allowed: POST)"),
    ("DELETE", "/health", None, None, 405, "MethodNotAllowedError",
     "method DELETE is not allowed on /health (allowed: GET)"),
    ("GET", "/v1/no-such-path", None, None, 404, "NotFoundError", "no such endpoint: GET /v1/no-such-path"),
    ("POST", "/v1/completions", b'{"model":', JSON, 400, "BadRequestError",
     "the request body is not valid JSON: Expecting value at character 9"),
    ("POST", "/v1/chat/completions", b"{not json", JSON, 400, "BadRequestError",
     "the request body is not valid JSON: Expecting property name enclosed in double quotes at character 1"),
    ("POST", "/v1/completions", b"[" * 100_000, JSON, 400, "BadRequestError",
     "the request body is not valid JSON: it is nested too deeply"),
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', JSON, 400, "BadRequestError",
     "the request body is not valid JSON: byte 12 is not valid UTF-8"),
    ("POST", "/v1/completions", b'\xff\xfe{"prompt"', JSON, 400, "BadRequestError",  # a UTF-16 byte-order mark
     "the request body is not valid JSON: it must be UTF-8, and its first bytes made it read as utf-16-le"),
    ("POST", "/v1/completions", b"[1]", JSON, 400, "BadRequestError",
     "the request body must be a JSON object (sent with Content-Type: application/json), got [1]"),
    ("POST", "/v1/completions", b'{"prompt": [1]}', {"Content-Type": "application/x-www-form-urlencoded"}, 400,
     "BadRequestError", "the request body must be a JSON object (sent with Content-Type: application/json), "
                        "got '{\"prompt\": [1]}'"),
])
def test_framework_errors_are_openai_json(tiny_server, method, path, body, headers, status, type, message):
    response = httpx.request(method, tiny_server.url + path, content=body, headers=headers, timeout=30)
    assert_openai_error(response, status, type, message)
    assert response.headers["content-type"] == "application/json"
    if status == 405:
        assert response.headers["Allow"] == message.rsplit("allowed: ", 1)[1].rstrip(")")


@pytest.mark.parametrize("body, message, param", [
    (None, "the request body is empty: send a JSON object (Content-Type: application/json)", None),
    (b'{"prompt": null}', "prompt: must be one of list[int], list[list[int]], str, list[str] (got null)", "prompt"),
    (b'{"prompt": {"a": 1}}', 'prompt: must be one of list[int], list[list[int]], str, list[str] '
                              '(got {"a": 1})', "prompt"),
])
def test_missing_body_and_union_fields_get_plain_messages(tiny_server, body, message, param):
    """No body at all, and a prompt of none of its accepted forms (found by a fresh user:
    "Field required" without a field, and pydantic's union branch names in the message)."""
    response = httpx.post(tiny_server.url + "/v1/completions", content=body, headers=JSON, timeout=30)
    assert_openai_error(response, 400, "BadRequestError", message, param)


def test_surrogate_echoed_in_an_error_keeps_the_response_valid_json(tiny_server):
    # "\ud800" is valid JSON but not UTF-8: echoing it in the message must not break the response
    response = httpx.post(tiny_server.url + "/v1/completions", headers=JSON,
                          content=b'{"model": "x\\ud800", "prompt": [1]}')
    assert_openai_error(response, 404, "NotFoundError",
                        "The model `x\ud800` does not exist; this server serves ['tiny']", "model")


SURROGATE = "prompt is not valid UTF-8 text: character 0 is the lone surrogate '\\ud800'"


@pytest.mark.parametrize("path, body, message, param", [
    ("/v1/completions", {"prompt": "\ud800 abc", "max_tokens": 2}, SURROGATE, None),
    ("/v1/completions", {"prompt": ["fine", "\ud800 abc"], "max_tokens": 2}, SURROGATE, None),
    ("/v1/completions", {"prompt": "\ud800 abc", "max_tokens": 2, "stream": True}, SURROGATE, None),
    ("/tokenize", {"prompt": "\ud800 abc"}, SURROGATE, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 abc"}]},
     "messages[0].content is not valid UTF-8 text: character 3 is the lone surrogate '\\ud800'",
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]}]},
     "messages[1].content is not valid UTF-8 text: character 2 is the lone surrogate '\\udfff'",
     "messages.1.content"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi", "name": "us\udc80er"}]},
     "messages[0].name is not valid UTF-8 text: character 2 is the lone surrogate '\\udc80'", "messages.0.name"),
])
def test_lone_surrogate_text_is_a_clean_400(chat_server, path, body, message, param):
    response = httpx.post(chat_server.url + path, headers=JSON, timeout=30,
                          content=json.dumps(body).encode())  # json.dumps escapes the surrogate
    assert_openai_error(response, 400, "BadRequestError", message, param)
    ok = httpx.post(chat_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.json()["usage"]["completion_tokens"] == 2
    wait_for_metrics(chat_server.url, idle)


def test_engine_refuses_text_that_is_not_utf8_naming_the_position():
    engine = make_tiny_engine()  # no tokenizer: the text is refused before that matters
    with pytest.raises(ValueError, match=r"^prompt is not valid UTF-8 text: character 4 is the lone "
                                         r"surrogate '\\udbff'$"):
        engine.add_request("x", "abc \udbff", SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


def test_unexpected_add_error_is_400_without_a_python_repr():
    engine = make_tiny_engine()

    def broken_add_request(*args, **kwargs):
        raise TypeError("TextEncodeInput must be a str")
    engine.add_request = broken_add_request
    with InThreadServer(engine) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1]}, timeout=30)
    assert_openai_error(response, 400, "BadRequestError",
                        "the request could not be added: TextEncodeInput must be a str")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("stream_options", [{"include_usage": True}, {}])
def test_stream_options_need_stream_true(tiny_server, path, body, stream_options):
    for stream in ({}, {"stream": False}):
        response = httpx.post(tiny_server.url + path, json={**body, **stream, "stream_options": stream_options},
                              timeout=30)
        assert_openai_error(response, 400, "BadRequestError",
                            "Stream options can only be defined when `stream=True`.", "stream_options")


def test_stream_options_with_stream_true_still_work(tiny_server):
    with httpx.stream("POST", tiny_server.url + "/v1/completions", timeout=30, json={
            "prompt": [1, 2], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as stream:
        events = sse_events(stream.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert all(event["usage"] is None for event in events[:-2])


def test_continuous_usage_stats_in_completions(tiny_server):
    """With ``continuous_usage_stats`` (vLLM's) every completions chunk carries its choice's
    usage so far: that choice's prompt and tokens (a fresh user found them summed over the
    request's choices; vLLM counts the chunk's own). Two prompts of 2 and 3 tokens, n=2."""
    with httpx.stream("POST", tiny_server.url + "/v1/completions", timeout=30, json={
            "prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as stream:
        events = sse_events(stream.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                                                   "total_tokens": 17}
    so_far: dict[int, list[int]] = {}
    for event in events[:-2]:
        (choice,) = event["choices"]
        usage = event["usage"]
        assert usage["prompt_tokens"] == [2, 3][choice["index"] // 2]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        so_far.setdefault(choice["index"], []).append(usage["completion_tokens"])
    assert sorted(so_far) == [0, 1, 2, 3]
    for counts in so_far.values():  # tokens may come several a chunk
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3


COMPLETION_INTS = ["max_tokens", "n", "logprobs", "seed", "top_k", "min_tokens", "best_of", "prompt_logprobs"]
CHAT_INTS = ["max_tokens", "max_completion_tokens", "n", "top_logprobs", "seed", "top_k", "min_tokens"]


@pytest.mark.parametrize("path, field", [("/v1/completions", f) for f in COMPLETION_INTS]
                         + [("/v1/chat/completions", f) for f in CHAT_INTS])
@pytest.mark.parametrize("value, shown", [("5", '"5"'), (True, "true"), (False, "false"), (5.0, "5.0"),
                                          ([5], "[5]")])
def test_integer_fields_take_json_integers_only(tiny_server, path, field, value, shown):
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": [1]}
    response = httpx.post(tiny_server.url + path, json={**body, field: value}, timeout=30)
    assert_openai_error(response, 400, "BadRequestError", f"{field}: Input should be a valid integer (got {shown})",
                        field)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": [True, 2]}, "prompt.0", "Input should be a valid integer (got true)"),
    ({"prompt": [1], "stop_token_ids": ["7"]}, "stop_token_ids.0", 'Input should be a valid integer (got "7")'),
    ({"prompt": [1], "temperature": "0.5"}, "temperature", 'Input should be a valid number (got "0.5")'),
    ({"prompt": [1], "top_p": True}, "top_p", "Input should be a valid number (got true)"),
    ({"prompt": [1], "logit_bias": {"1": "5"}}, "logit_bias.1", 'Input should be a valid number (got "5")'),
    ({"prompt": [1], "logit_bias": {"1": 500}}, "logit_bias.1", "Input should be less than or equal to 100 (got 500)"),
    ({"prompt": [1], "stream": "true"}, "stream", 'Input should be a valid boolean (got "true")'),
    ({"prompt": [1], "echo": 1}, "echo", "Input should be a valid boolean (got 1)"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     'Input should be a valid boolean (got "yes")'),
])
def test_number_and_boolean_fields_are_not_coerced(tiny_server, body, param, message):
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert_openai_error(response, 400, "BadRequestError", f"{param}: {message}", param)


def test_json_integers_and_numbers_are_still_accepted(tiny_server):
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "seed": 7, "top_k": 5, "min_tokens": 4, "best_of": 2,
            "logprobs": 1, "temperature": 1, "top_p": 1, "presence_penalty": 0, "logit_bias": {"3": 1},
            "stop_token_ids": [0], "echo": False}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [4, 4]
    assert response.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


@pytest.fixture(scope="module")
def tiny_server():
    with InThreadServer(make_tiny_engine()) as server:
        yield server


@pytest.fixture(scope="module")
def chat_server():
    """The tiny llama with SmolLM2's tokenizer and chat template (text prompts, chat)."""
    smollm2_tokenizer()
    args = EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=16,
                                  max_num_batched_tokens=64)
    with InThreadServer(tiny_chat_engine(args)) as server:
        yield server


@pytest.mark.parametrize("top_logprobs,message", [
    (50, "top_logprobs must be in [0, 20], got 50"),
    (-1, "top_logprobs=-1 asks for the whole vocabulary, more than the 20 alternatives per token allowed "
         "(vLLM's max_logprobs); ask for 0 to 20")])
def test_chat_top_logprobs_out_of_range_names_top_logprobs(chat_server, top_logprobs, message):
    """Chat's ``top_logprobs`` is ``SamplingParams.logprobs`` inside; the 400 names the field
    the client sent, also where the message gives it as ``field=value`` (both found by fresh users)."""
    response = httpx.post(chat_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": top_logprobs,
        "max_tokens": 2})
    assert_openai_error(response, 400, "BadRequestError", message, "top_logprobs")
