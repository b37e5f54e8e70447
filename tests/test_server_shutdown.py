"""SIGTERM drains a real ``pagedllm serve`` process: open requests finish or get a terminal
error, new ones get 503, and the process exits with status 0; no open stream holds the exit up."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import _tiny_model
from tests.test_server import ServerProcess, slowed, sse_events, wait_for_metrics

STEP_SECONDS = 0.05


def slow_tiny_engine(engine_args: EngineArgs) -> LLMEngine:
    """conftest's tiny llama (no tokenizer), each step made to last ``STEP_SECONDS`` so that a
    long request outlives the drain timeout (the engine factory of this test)."""
    import torch
    return slowed(LLMEngine(engine_args, model=_tiny_model(torch.float32, 0), tokenizer=None),
                  STEP_SECONDS)


def serve_slow_tiny(tmp_path, *args: str) -> ServerProcess:
    """A ready server over ``slow_tiny_engine`` that takes SIGINT as Python does by default: a
    child inherits an ignored SIGINT, and an earlier test may have left this process so."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server = ServerProcess("--max-model-len", "256", "--block-size", "4",
                               "--kv-cache-memory-bytes", str(2**20), *args, log_path=tmp_path / "server.log",
                               engine_factory="tests.test_server_shutdown:slow_tiny_engine")
    finally:
        signal.signal(signal.SIGINT, handler)
    return server.wait_ready()


# Bounds on how soon a signal ends the open streams, not on the exit: the process's own
# teardown (torch's alone is 0.7 s) took 1.4 s on an idle 2-core machine and 4.5 s on a busy one.
# uvicorn's graceful shutdown waited 5 s for a stream before cancelling it.
STREAM_END_SECONDS = 3


def signal_and_wait_for_drain(server, sig: int) -> None:
    """Send ``sig`` and wait (up to 10 s) until ``/health`` answers 503: the drain has begun."""
    server.proc.send_signal(sig)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_open_kv_stream_ends_at_once_on_shutdown(tmp_path, sig):
    # The live view's stream is endless: uvicorn waited for it for its whole graceful timeout,
    # then cancelled it with a traceback (the process took 6.7 s to exit with the default model).
    server = serve_slow_tiny(tmp_path)
    events: list = []
    first_event = threading.Event()
    ended_at: list[float] = []

    def watch() -> None:
        with httpx.stream("GET", server.url + "/debug/kv/stream", timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
                    first_event.set()
        ended_at.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        assert first_event.wait(30)
        signalled_at = time.monotonic()
        server.proc.send_signal(sig)
        watcher.join(30)
        assert ended_at and ended_at[0] - signalled_at < STREAM_END_SECONDS
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    assert events[0]["num_blocks"] > 0
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_a_second_sigint_ends_the_drain_at_once_quietly(tmp_path):
    # 250 tokens at >= STEP_SECONDS a step outlast the test's waits, and the drain's 60 s.
    server = serve_slow_tiny(tmp_path, "--drain-timeout", "60")
    results: dict[str, list] = {}
    ended_at: list[float] = []

    def stream() -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 250, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            results["long"] = sse_events(response.iter_lines())
        ended_at.append(time.monotonic())

    client = threading.Thread(target=stream, daemon=True)
    try:
        client.start()
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 1, timeout=30)
        signal_and_wait_for_drain(server, signal.SIGINT)
        assert not ended_at  # draining: the request still runs
        signalled_at = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        client.join(30)
        assert ended_at and ended_at[0] - signalled_at < STREAM_END_SECONDS
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    long = results["long"]
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == 503 and "drain" in long[-2]["error"]["message"]
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_sigterm_drains_then_exits_0(tmp_path):
    # The keys file also checks --api-keys-file end to end: its key is required and never logged.
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps([{"name": "drainer", "key": "sk-drain-secret", "requests_per_minute": 100}]))
    headers = {"Authorization": "Bearer sk-drain-secret"}
    server = ServerProcess("--drain-timeout", "3", "--max-model-len", "128", "--block-size", "4",
                           "--api-keys-file", str(keys_file),
                           "--kv-cache-memory-bytes", str(2**20), log_path=tmp_path / "server.log",
                           engine_factory="tests.test_server_shutdown:slow_tiny_engine").wait_ready()
    results: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                          timeout=60) as response:
            results[name] = sse_events(response.iter_lines())

    def post(name: str, max_tokens: int) -> None:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": max_tokens},
                              headers=headers, timeout=60)
        results[name] = (response.status_code, response.json())

    long_threads = [threading.Thread(target=stream, args=("long", 120)),
                    threading.Thread(target=post, args=("long_plain", 120))]
    short_threads = [threading.Thread(target=stream, args=("short", 20)),
                     threading.Thread(target=post, args=("short_plain", 20))]
    threads = long_threads + short_threads
    try:
        for thread in long_threads:
            thread.start()
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 2, timeout=30)
        for thread in short_threads:
            thread.start()
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 4, timeout=30)
        signal_and_wait_for_drain(server, signal.SIGTERM)
        # Draining: not ready for new work, but alive (a platform must not restart it).
        readyz = httpx.get(server.url + "/readyz")
        assert readyz.status_code == 503 and "shutting down" in readyz.json()["error"]["message"]
        assert httpx.get(server.url + "/livez").json() == {"status": "alive"}
        assert httpx.get(server.url + "/load").json()["draining"] is True
        assert httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 401
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=headers)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert refused.headers["x-ratelimit-limit-requests"] == "100"
        for thread in threads:
            thread.join(30)
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == 503 and "drain" in long[-2]["error"]["message"]
    assert results["short_plain"][0] == 200 and results["short_plain"][1]["usage"]["completion_tokens"] == 20
    assert results["long_plain"][0] == 503
    assert "sk-drain-secret" not in (tmp_path / "server.log").read_text()
