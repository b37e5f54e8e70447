"""The production API layer over real HTTP on loopback (issue 15): per-key limits and their
headers, priorities, health and load, overload protection, cancellation and request ids.

Servers are ``build_app`` over the tiny random llama (token-id prompts) served by uvicorn in a
thread (``InThreadServer``), so that a test can slow or pause the engine's steps, inject the
rate limiter's clock (a frozen clock makes bucket levels exact) and record which requests the
scheduler preempted. Clients are the official ``openai`` client and ``httpx``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time

import httpx
import openai
import pytest

from pagedllm.entrypoints.openai.api_keys import APIKey, format_reset, parse_api_keys
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from tests.conftest import make_tiny_engine
from tests.test_server import InThreadServer, MODEL, scrape, slowed, sse_events, wait_for_metrics

KEY_A, KEY_B = "sk-a-secret-0001", "sk-b-secret-0002"


class FrozenClock:
    """The rate limiter's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def auth(key: str, **headers: str) -> dict[str, str]:
    """``key``'s bearer header and ``headers`` (no Authorization for an empty key)."""
    return {"Authorization": f"Bearer {key}", **headers} if key else headers


def completion(url: str, key: str, prompt=(1, 2, 3), max_tokens: int = 4, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=auth(key), timeout=60,
                      json={"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens,
                            "ignore_eos": True, **body})


def seconds(reset: str) -> float:
    """An ``x-ratelimit-reset-*`` value back in seconds (the forms ``format_reset`` writes)."""
    if reset.endswith("ms"):
        return int(reset[:-2]) / 1000
    total, number = 0.0, ""
    for char in reset:
        if char in "hms":
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[char]
            number = ""
        else:
            number += char
    return total


# --------------------------------------------------------------------------------- keys file
def test_format_reset_writes_durations_as_openai():
    assert [format_reset(s) for s in (0, 0.017, 0.9994, 1, 1.5, 20.366, 60, 360, 3600, 3661.5)] == \
        ["0s", "17ms", "999ms", "1s", "1.5s", "20.366s", "1m0s", "6m0s", "1h0m0s", "1h1m1.5s"]


def test_keys_file_errors_name_the_entry_and_field_never_the_key():
    keys = parse_api_keys('[{"name": "a", "key": "sk-1", "requests_per_minute": 3, "priority": -1},'
                          ' {"name": "b", "key": "sk-2"}]', "keys.json")
    assert keys == [APIKey("a", "sk-1", 3, None, None, -1), APIKey("b", "sk-2")]
    assert "sk-1" not in repr(keys)
    bad = [('{"name": "a"}', "must be a non-empty JSON list"),
           ('[{"name": "a b", "key": "sk-secret"}]', "entry 0: name must be 1-64 characters"),
           ('[{"name": "anonymous", "key": "sk-secret"}]', "not 'anonymous'"),
           ('[{"name": "a", "key": ""}]', "key 'a': key must be a non-empty string"),
           ('[{"name": "a", "key": "sk-secret", "rpm": 3}]', "unknown field(s) ['rpm']"),
           ('[{"name": "a", "key": "sk-secret", "tokens_per_minute": 0}]',
            "tokens_per_minute must be a positive integer or null, got 0"),
           ('[{"name": "a", "key": "sk-secret", "priority": 1.5}]', "priority must be an integer, got 1.5"),
           ('[{"name": "a", "key": "sk-secret"}, {"name": "b", "key": "sk-secret"}]',
            "key 'b': its key is also another entry's key"),
           ('[{"name": "a", "key": "sk-secret"}, {"name": "a", "key": "sk-other"}]', "the name is used twice"),
           ("[{", "not valid JSON")]
    for text, message in bad:
        with pytest.raises(ValueError) as error:
            parse_api_keys(text, "keys.json")
        assert message in str(error.value) and "sk-secret" not in str(error.value)


# --------------------------------------------------------------------------------- limits
def test_two_keys_a_at_its_request_limit_gets_429_with_headers_while_b_is_served(caplog):
    caplog.set_level(logging.INFO, logger="pagedllm")
    clock = FrozenClock()
    keys = [APIKey("A", KEY_A, requests_per_minute=3), APIKey("B", KEY_B, requests_per_minute=100)]
    with InThreadServer(make_tiny_engine(), app_kwargs={"api_keys": keys, "clock": clock}) as server:
        client_a = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        client_b = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)

        def create(client, request_id: str):
            return client.completions.with_raw_response.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": request_id})

        for i in range(3):
            raw = create(client_a, f"a-{i}")
            assert raw.http_response.status_code == 200
            assert raw.parse().id == f"cmpl-a-{i}" and raw.headers["x-request-id"] == f"a-{i}"
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            assert raw.headers["x-ratelimit-remaining-requests"] == str(2 - i)
            # One request token refills in 60 / 3 = 20 s; the bucket is full after 20 s per missing one.
            assert raw.headers["x-ratelimit-reset-requests"] == ["20s", "40s", "1m0s"][i]
            assert "x-ratelimit-limit-tokens" not in raw.headers  # A has no token limit
            raw_b = create(client_b, f"b-{i}")
            assert raw_b.http_response.status_code == 200
            assert raw_b.headers["x-ratelimit-remaining-requests"] == str(99 - i)

        with pytest.raises(openai.RateLimitError) as refused:
            create(client_a, "a-3")
        response = refused.value.response
        assert response.status_code == 429 and response.headers["retry-after"] == "20"
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        assert response.headers["x-ratelimit-reset-requests"] == "1m0s"
        assert response.headers["x-request-id"] == "a-3"
        assert "requests_per_minute of 3" in response.json()["error"]["message"]
        assert create(client_b, "b-3").http_response.status_code == 200  # B never waits for A

        clock.now += 19.9
        with pytest.raises(openai.RateLimitError) as refused:
            create(client_a, "a-4")
        assert refused.value.response.headers["retry-after"] == "1"  # 0.1 s left, rounded up
        clock.now += 0.1
        assert create(client_a, "a-5").http_response.status_code == 200

        values = wait_for_metrics(server.url, lambda v: v['pagedllm:api_key_requests_open{key_name="A"}'] == 0)
        assert values['pagedllm:api_key_requests_total{key_name="A",outcome="admitted"}'] == 4
        assert values['pagedllm:api_key_requests_total{key_name="A",outcome="rate_limited"}'] == 2
        assert values['pagedllm:api_key_requests_total{key_name="B",outcome="admitted"}'] == 4
        assert values['pagedllm:api_key_tokens_total{key_name="A"}'] == 4 * (3 + 2)
        names = {key.split('key_name="')[1].split('"')[0] for key in values if 'key_name="' in key}
        assert names == {"A", "B"}  # bounded: configured names only (anonymous only on a server without keys)
        metrics_text = httpx.get(server.url + "/metrics").text
        # An unknown key is refused before anything is counted under its name.
        assert completion(server.url, "sk-unknown").status_code == 401
    for secret in (KEY_A, KEY_B):
        assert secret not in caplog.text and secret not in metrics_text
    assert "X-Request-Id 'a-0'" in caplog.text  # the client's id names the request in logs


def test_tokens_per_minute_reserves_prompt_plus_max_tokens_and_charges_usage():
    clock = FrozenClock()
    keys = [APIKey("T", KEY_A, tokens_per_minute=1000)]
    with InThreadServer(make_tiny_engine(max_model_len=1024, num_gpu_blocks_override=512),
                        app_kwargs={"api_keys": keys, "clock": clock}) as server:
        prompt = list(range(1, 11))  # 10 tokens
        # Only token 5 may be sampled and it stops the request: 1 token generated of 50 reserved.
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 50, "allowed_token_ids": [5],
                "stop_token_ids": [5], "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(KEY_A),
                          timeout=60) as stream:
            assert stream.status_code == 200
            # Sent when the stream starts: the reservation, 10 + 1 * 50.
            assert stream.headers["x-ratelimit-limit-tokens"] == "1000"
            assert stream.headers["x-ratelimit-remaining-tokens"] == str(1000 - 60)
            usage = sse_events(stream.iter_lines())[-2]["usage"]
        assert usage == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}

        def remaining() -> int:
            return int(httpx.get(server.url + "/v1/models", headers=auth(KEY_A)).headers["x-ratelimit-remaining-tokens"])

        deadline = time.monotonic() + 10
        while remaining() != 1000 - 11:  # the stream's close gives back 49 unused tokens
            assert time.monotonic() < deadline, remaining()
            time.sleep(0.02)
        # n=2 reserves 10 + 2 * 20 = 50 and is charged 10 + 2 * 20 = 50 (ignore_eos).
        two = completion(server.url, KEY_A, prompt, max_tokens=20, n=2)
        assert two.status_code == 200 and two.json()["usage"]["total_tokens"] == 50
        assert remaining() == 1000 - 11 - 50
        reset = seconds(httpx.get(server.url + "/v1/models", headers=auth(KEY_A)).headers["x-ratelimit-reset-tokens"])
        assert reset == pytest.approx(61 / (1000 / 60), abs=1e-3)  # 61 tokens at 1000/60 per s

        # 10 + 930 = 940 > 939 left: short by one token, which refills in 0.06 s.
        short = completion(server.url, KEY_A, prompt, max_tokens=930)
        assert short.status_code == 429 and short.headers["retry-after"] == "1"
        assert short.headers["x-ratelimit-remaining-tokens"] == "939"
        assert completion(server.url, KEY_A, prompt, max_tokens=929, allowed_token_ids=[5],
                          stop_token_ids=[5]).status_code == 200
        never = completion(server.url, KEY_A, prompt, max_tokens=991)  # 1001 tokens > 1000 per minute
        assert never.status_code == 429 and "retry-after" not in never.headers
        assert "needs 1001 tokens" in never.json()["error"]["message"]


def test_concurrency_limit_and_key_priority_rules():
    keys = [APIKey("C", KEY_A, max_concurrent_requests=1, priority=2)]
    engine = slowed(make_tiny_engine(scheduling_policy="priority"), 0.02)
    with InThreadServer(engine, app_kwargs={"api_keys": keys}) as server:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 30, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(KEY_A),
                          timeout=60) as stream:
            assert stream.status_code == 200
            second = completion(server.url, KEY_A)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert "max_concurrent_requests" in second.json()["error"]["message"]
            list(stream.iter_lines())
        deadline = time.monotonic() + 10
        while (response := completion(server.url, KEY_A)).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert response.status_code == 200
        urgent = completion(server.url, KEY_A, priority=1)
        assert urgent.status_code == 400 and urgent.json()["error"]["param"] == "priority"
        assert completion(server.url, KEY_A, priority=3).status_code == 200


def test_priority_needs_the_priority_policy():
    with InThreadServer(make_tiny_engine()) as server:
        refused = completion(server.url, "", priority=1)
        assert refused.status_code == 400
        assert "needs scheduling_policy='priority'" in refused.json()["error"]["message"]
        assert completion(server.url, "", priority=0).status_code == 200
    with pytest.raises(ValueError, match="set a priority, which needs --scheduling-policy priority"):
        InThreadServer(make_tiny_engine(), app_kwargs={"api_keys": [APIKey("p", KEY_A, priority=1)]})


# --------------------------------------------------------------------------------- priority
def test_a_high_priority_request_overtakes_twenty_queued_low_priority_ones():
    engine = slowed(make_tiny_engine(scheduling_policy="priority", priority_aging_interval=0, max_num_seqs=2,
                                     max_num_batched_tokens=64), 0.01)
    with InThreadServer(engine) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        finished: list[str] = []

        async def run(name: str, priority: int) -> None:
            await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8,
                                            extra_body={"ignore_eos": True, "priority": priority})
            finished.append(name)

        async def main() -> None:
            low = [asyncio.create_task(run(f"low-{i}", 10)) for i in range(20)]
            deadline = time.monotonic() + 30
            while (await asyncio.to_thread(httpx.get, server.url + "/load")).json()["waiting"] < 15:
                assert time.monotonic() < deadline
            await asyncio.gather(run("high", 0), *low)

        asyncio.run(main())
        assert len(finished) == 21
        # Two seats: the high one takes the next free seat, ahead of every waiting low one.
        assert finished.index("high") <= 4, finished


def test_under_block_pressure_the_preempted_requests_are_low_priority():
    # 16 blocks of 4 tokens: four requests of 4 + 24 tokens (7 blocks each) cannot all fit.
    engine = slowed(make_tiny_engine(scheduling_policy="priority", priority_aging_interval=0,
                                     num_gpu_blocks_override=16, max_model_len=64), 0.01)
    scheduler = engine.scheduler
    victims: list[int] = []
    preempt = scheduler._preempt

    def recording_preempt(request):  # runs on the engine thread
        victims.append(request.priority)
        preempt(request)
    scheduler._preempt = recording_preempt
    with InThreadServer(engine) as server:
        results: dict[str, dict] = {}

        def post(name: str, priority: int) -> None:
            results[name] = completion(server.url, "", prompt=[1, 2, 3, 4], max_tokens=24,
                                       priority=priority).json()

        low = [threading.Thread(target=post, args=(f"low-{i}", 5)) for i in range(2)]
        high = [threading.Thread(target=post, args=(f"high-{i}", 0)) for i in range(2)]
        for thread in low:
            thread.start()
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 2, timeout=30)
        for thread in high:
            thread.start()
        for thread in low + high:
            thread.join(60)
        values = wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 0)
    assert victims and set(victims) == {5}, victims
    assert values["pagedllm:num_preemptions_total"] == len(victims)
    assert all(result["usage"]["completion_tokens"] == 24 for result in results.values()), results


# --------------------------------------------------------------------------------- health, load
class GatedSteps:
    """The engine thread steps only while ``allowed`` > 0 (each step takes one); until then it
    sees no work and keeps taking commands, so requests queue up and the snapshots hold still.
    ``kill()`` makes the next step raise, killing the engine loop."""

    def __init__(self, engine) -> None:
        self.allowed = 0.0
        self.die = False
        has_work, step = engine.has_unfinished_requests, engine.step
        engine.has_unfinished_requests = lambda: (self.allowed > 0 or self.die) and has_work()

        def gated_step():
            if self.die:
                raise RuntimeError("injected engine failure")
            self.allowed -= 1
            return step()
        engine.step = gated_step

    def allow(self, steps: float) -> None:
        self.allowed = steps

    def kill(self) -> None:
        self.die = True


def test_load_equals_metrics_then_livez_readyz_and_requests_fail_fast_when_the_engine_dies():
    engine = make_tiny_engine(max_num_seqs=2)
    gate = GatedSteps(engine)
    with InThreadServer(engine) as server:
        server.metrics.log_interval = 0.02  # how often an idle engine thread wakes (to see the gate)
        url = server.url
        assert httpx.get(url + "/livez").json() == {"status": "alive"}
        assert httpx.get(url + "/readyz").json() == {"status": "ready"}
        threads = [threading.Thread(target=completion, args=(url, ""), kwargs={"prompt": [1] * 8, "max_tokens": 4})
                   for _ in range(3)]
        for thread in threads:
            thread.start()

        def load_when(running: int, waiting: int) -> dict:
            deadline = time.monotonic() + 30
            while True:
                load = httpx.get(url + "/load").json()
                if (load["running"], load["waiting"]) == (running, waiting):
                    return load
                assert time.monotonic() < deadline, load
                time.sleep(0.01)

        load_when(0, 3)
        gate.allow(1)  # one step: the prefill of two requests; the third waits for a seat
        load = load_when(2, 1)
        values = scrape(url)
        # 8 prompt tokens in 4-token blocks: 2 blocks for each running request.
        assert (load["running"], load["waiting"], load["num_used_blocks"], load["num_blocks"]) == (2, 1, 4, 64)
        assert values["pagedllm:num_requests_running"] == load["running"]
        assert values["pagedllm:num_requests_waiting"] == load["waiting"]
        assert values["pagedllm:kv_cache_usage_perc"] == load["kv_cache_usage"] == 4 / 64
        assert load["open_requests"] == 3 and load["healthy"] and not load["draining"]
        assert load["step_time_s"] > 0 and load["finish_rate"] == 0 and load["estimated_wait_s"] is None

        gate.allow(math.inf)
        for thread in threads:
            thread.join(30)
        wait_for_metrics(url, lambda v: v["pagedllm:num_requests_running"] == 0)
        load = httpx.get(url + "/load").json()
        assert (load["running"], load["waiting"], load["num_used_blocks"]) == (0, 0, 0)
        assert load["finish_rate"] > 0 and load["estimated_wait_s"] == load["step_time_s"]

        # An open request and new ones get 503 at once when the engine loop dies.
        gate.allow(0)
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as stream:
            gate.kill()
            events = sse_events(stream.iter_lines())
        assert events[-2]["error"]["code"] == 503 and "died" in events[-2]["error"]["message"]
        start = time.monotonic()
        refused = completion(url, "")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "30"
        assert time.monotonic() - start < 2
        assert httpx.get(url + "/livez").status_code == 503
        assert httpx.get(url + "/readyz").status_code == 503
        assert httpx.get(url + "/load").json()["healthy"] is False


# --------------------------------------------------------------------------------- overload
def test_overload_refuses_at_once_what_would_wait_past_the_slo_and_serves_the_rest():
    engine = slowed(make_tiny_engine(max_num_seqs=1), 0.02)
    with InThreadServer(engine, app_kwargs={"max_queue_wait": 2.0}) as server:
        url = server.url
        for _ in range(3):  # a finish rate to estimate from
            assert completion(url, "", max_tokens=10).status_code == 200
        results: list[int] = []
        threads: list[threading.Thread] = []
        refused = None
        # One seat: each long request queues behind the others, until the estimated wait of
        # the next, (waiting + 1) / finish rate, passes 2 s.
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            load = httpx.get(url + "/load").json()
            estimate = load["estimated_wait_s"]
            start = time.monotonic()
            if estimate is not None and estimate > 2.5:  # clearly over: this one must be refused
                refused = completion(url, "", max_tokens=10)
                elapsed = time.monotonic() - start
                break
            if estimate is not None and estimate > 2.0:
                # Between the limit and "clearly over" a new request would be refused and the
                # queue would not grow; the finish rate is counted up to now, so the estimate
                # rises by itself until the next finish (it flaked once with a fixed 10 tries).
                time.sleep(0.05)
                continue
            thread = threading.Thread(target=lambda: results.append(completion(url, "", max_tokens=100).status_code))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 30
            while httpx.get(url + "/load").json()["open_requests"] < len(threads) and not results:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert refused is not None, load
        assert refused.status_code == 503 and elapsed < 2.0, refused.text
        message = refused.json()["error"]["message"]
        assert "overloaded" in message
        assert float(message.split("about ")[1].split(" s")[0]) > 2.0
        assert int(refused.headers["retry-after"]) >= 1
        for thread in threads:
            thread.join(120)
        # What was admitted is served; what would have waited too long was not queued at all.
        num_accepted = sum(1 for status in results if status == 200)
        assert num_accepted >= 1 and len(results) == len(threads)
        values = scrape(url)
        assert values['pagedllm:api_key_requests_total{key_name="anonymous",outcome="overloaded"}'] == \
            len(threads) - num_accepted + 1
        assert values['pagedllm:api_key_requests_total{key_name="anonymous",outcome="admitted"}'] == 3 + num_accepted


# --------------------------------------------------------------------------------- cancel, ids
def test_cancel_is_refused_to_another_key_and_client_ids_never_collide_across_keys():
    keys = [APIKey("A", KEY_A), APIKey("B", KEY_B)]
    engine = slowed(make_tiny_engine(), 0.1)  # 120 tokens take 12 s: both are cancelled long before
    with InThreadServer(engine, app_kwargs={"api_keys": keys}) as server:
        url = server.url
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 120, "ignore_eos": True}

        def cancel(key: str, request_id: str) -> httpx.Response:
            return httpx.post(url + f"/v1/requests/{request_id}/cancel", headers=auth(key), timeout=10)

        b_result: dict = {}

        def b_request() -> None:  # B's request uses the same X-Request-Id as A's
            response = httpx.post(url + "/v1/completions", headers=auth(KEY_B, **{"X-Request-Id": "shared"}),
                                  json=body, timeout=60)
            b_result.update(status=response.status_code, id=response.json()["id"],
                            echoed=response.headers["x-request-id"],
                            finish=response.json()["choices"][0]["finish_reason"])

        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=stream_body, timeout=60,
                          headers=auth(KEY_A, **{"X-Request-Id": "shared"})) as stream:
            assert stream.status_code == 200 and stream.headers["x-request-id"] == "shared"
            wait_for_metrics(url, lambda v: v["pagedllm:num_requests_running"] == 1, timeout=30)
            # B knows A's ids but reaches nothing of A's: not by them, nor by an engine-looking id.
            for request_id in ("shared", "cmpl-shared", "A/shared", "A"):
                refused = cancel(KEY_B, request_id)
                assert refused.status_code == 404 and refused.json()["error"]["type"] == "NotFoundError"
            thread = threading.Thread(target=b_request)
            thread.start()
            wait_for_metrics(url, lambda v: v["pagedllm:num_requests_running"] == 2, timeout=30)
            # The same client id under two keys: two requests, each cancelled by its own key only.
            assert cancel(KEY_B, "shared").json() == {"id": "shared", "object": "request.cancelled", "cancelled": 1}
            thread.join(60)
            assert b_result == {"status": 200, "id": "cmpl-shared", "echoed": "shared", "finish": "abort"}
            assert httpx.get(url + "/load").json()["running"] == 1  # A's still runs
            assert cancel(KEY_A, "cmpl-shared").json()["cancelled"] == 1
            events = sse_events(stream.iter_lines())
        assert events[-1] == "[DONE]" and {event["id"] for event in events[:-1]} == {"cmpl-shared"}
        assert events[-3]["choices"][0]["finish_reason"] == "abort"
        assert events[-2]["usage"]["completion_tokens"] < 120  # cut short by its own key's cancel
        assert cancel(KEY_A, "shared").status_code == 404  # ended
        assert completion(url, KEY_A).json()["id"].startswith("cmpl-")  # no X-Request-Id: one is made up
        bad = httpx.get(url + "/v1/models", headers=auth(KEY_A, **{"X-Request-Id": "has space"}))
        assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]
        assert bad.headers["x-request-id"] != "has space"



def test_malformed_request_ids_are_400s_that_quote_them_readably():
    """Found by the fresh-user check: an id with '/' was accepted but could never be cancelled
    (it is a path segment), and a non-ASCII one was quoted as mojibake."""
    with InThreadServer(make_tiny_engine()) as server:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
        for request_id, shown in [("a/b", '"a/b"'), ("é".encode(), None), ("x" * 129, None)]:
            response = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": request_id},
                                  json=body, timeout=30)
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert message.startswith("X-Request-Id must be 1-128 printable ASCII characters without spaces or '/'")
            if shown is not None:
                assert message.endswith(f"got {shown}"), message
            assert "\u00c3" not in response.text and "Ã" not in message  # é decoded as UTF-8, not Latin-1
        ok = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "a.b-c_d"}, json=body, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "a.b-c_d"


def test_a_body_over_the_limit_is_a_413_and_the_server_serves_on():
    """Nothing bounded a request body: one huge POST was read whole into the server's memory.
    Over ``max_request_body_bytes`` it is refused by its Content-Length before reading, and a
    chunked one (no Content-Length) as soon as what was read passes the limit."""
    with InThreadServer(make_tiny_engine(), app_kwargs={"max_request_body_bytes": 1000}) as server:
        url = server.url + "/v1/completions"
        big = json.dumps({"model": MODEL, "prompt": [1] * 400, "max_tokens": 1}).encode()
        response = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
        assert response.status_code == 413
        assert response.json()["error"]["message"] == (
            f"the request body is {len(big)} bytes, over the server's limit of 1000 bytes (--max-request-body-bytes)")

        def chunked():
            for start in range(0, len(big), 100):
                yield big[start:start + 100]
        response = httpx.post(url, content=chunked(), headers={"Content-Type": "application/json"}, timeout=30)
        assert "content-length" not in response.request.headers
        assert response.status_code == 413
        assert response.json()["error"]["message"].startswith("the request body is more than 1000 bytes")
        small = completion(server.url, "", prompt=[1] * 100, max_tokens=2)
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
        assert len(small.request.content) <= 1000
    with pytest.raises(ValueError, match="max_request_body_bytes must be >= 1, got 0"):
        build_app(None, ServerArgs(served_model_name=[MODEL], max_request_body_bytes=0))


class _SentencePieceBytes:
    """A stand-in tokenizer whose vocabulary has SentencePiece byte pieces (Gemma, Llama 2)."""

    pieces = {0: "<0xF0>", 1: "<0x9F>", 2: "<0x98>", 3: "<0x80>", 4: "▁cat"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids: list[int]) -> str:
        return "\ufffd" if token_ids[0] < 4 else " cat"


def test_chat_logprob_bytes_are_each_tokens_own_bytes():
    """OpenAI's ``logprobs.content[].bytes``: the token's bytes, so that those of a character cut
    over several tokens join back into it (a new user found U+FFFD's three bytes for every
    piece of an emoji). SmolLM2's byte-level BPE and SentencePiece byte pieces."""
    from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
    from pagedllm.models.loader import load_tokenizer, model_folder, resolve_model_path

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.tokenizer = load_tokenizer(model_folder(resolve_model_path(None)))
    text = "héllo 😀 日本 <|im_end|>"
    token_ids = serving.tokenizer.encode(text, add_special_tokens=False)
    assert any(serving.tokenizer.decode([t]) == "\ufffd" for t in token_ids)  # the case at hand
    assert b"".join(bytes(serving.token_bytes(t)) for t in token_ids) == text.encode()
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.tokenizer = _SentencePieceBytes()
    assert b"".join(bytes(serving.token_bytes(t)) for t in range(4)) == "😀".encode()
    assert serving.token_bytes(4) == list(b" cat")
