"""The OpenAI-compatible server as a real process, driven by the official ``openai`` client.

The server runs ``pagedllm serve`` over a tiny random llama that uses SmolLM2's tokenizer and
vocabulary (``tiny_chat_engine``), so that text, chat templates and tokenization are real while
a step costs milliseconds. References are the same model run offline one request at a time, and
Hugging Face ``transformers`` for logprobs.

Also home of the helpers the other server tests import (server process, in-thread server,
metrics scraping, SSE parsing).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_keys import DEFAULT_KEY_NAME, APIKey
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from pagedllm.metrics import EngineMetrics
from pagedllm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 4096


# --------------------------------------------------------------------------------- helpers
def slowed(engine, seconds: float):
    """Make every engine step take at least ``seconds``, so that requests stay in flight."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    engine.step = slow_step
    return engine


def failing_at_step(engine, n: int):
    """Make the engine's ``n``-th step raise (a fault that kills the engine loop)."""
    step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected fault")
        return step()
    engine.step = failing_step
    return engine


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from pagedllm.models.loader import load_tokenizer, resolve_model_path
    return load_tokenizer(resolve_model_path(None))


def tiny_chat_config():
    tokenizer = smollm2_tokenizer()
    return tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       max_position_embeddings=MAX_MODEL_LEN)


def tiny_chat_engine(engine_args: EngineArgs) -> LLMEngine:
    """A tiny random llama with SmolLM2's vocabulary, tokenizer and chat template (the server
    tests' engine factory: ``ServerProcess(engine_factory=...)``)."""
    from pagedllm.models.loader import build_model
    config = tiny_chat_config()
    model = build_model(config, tiny_state_dict(config), torch.float32)
    return LLMEngine(engine_args, model=model, tokenizer=smollm2_tokenizer())


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Compute references with the server process's thread count (OMP_NUM_THREADS=1), so that
    fp32 reductions, hence greedy ties, come out the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A loopback port free now, from 20000-32767: below Linux's ephemeral range (32768 on),
    where the processes a server starts (Ray's raylet, GCS and agents) bind their own ports in
    the moment before the server binds this one (a Ray Serve proxy once failed to bind a port
    the OS had handed out at random), and above Ray's worker ports (10002-19999)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000-32767")


class ServerProcess:
    """``pagedllm serve ...`` in a child process on a free loopback port; with
    ``engine_factory`` (``module:function``), over the engines it builds
    (``tests/serve_launcher.py``)."""

    def __init__(self, *args: str, log_path: Path, engine_factory: Optional[str] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
        self.log = open(log_path, "w")
        command = ["-m", "pagedllm.entrypoints.cli", "serve"] if engine_factory is None else \
            ["-m", "tests.serve_launcher", engine_factory]
        self.proc = subprocess.Popen(
            [sys.executable, *command, "--port", str(self.port), *args],
            cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> "ServerProcess":
        """Block until /health answers 200 (the process was started by the constructor)."""
        log_path = self.log_path
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{log_path.read_text()}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class InThreadServer:
    """uvicorn serving ``build_app`` over an ``AsyncLLMEngine`` in a thread of this process
    (for configurations and failure injection that need the engine at hand).

    ``app_kwargs`` are ``ServerArgs`` fields, and ``build_app``'s ``api_keys`` and ``clock``;
    the keys are ``api_key`` (named ``default``) and ``api_keys`` only, never the environment's.
    """

    def __init__(self, engine: LLMEngine, served_model_name: str = MODEL, api_key: Optional[str] = None,
                 app_kwargs: Optional[dict] = None, **async_engine_kwargs) -> None:
        self.metrics = EngineMetrics(served_model_name, engine.max_model_len, engine.args.max_num_seqs,
                                     engine.args.max_num_batched_tokens, model_info=engine.get_model_info())
        self.engine = AsyncLLMEngine(engine, self.metrics, **async_engine_kwargs)
        self.engine.start()
        server_options = dict(app_kwargs or {})
        api_keys = list(server_options.pop("api_keys", [])) + ([APIKey(DEFAULT_KEY_NAME, api_key)] if api_key else [])
        clock = server_options.pop("clock", time.monotonic)
        app = build_app(self.engine, ServerArgs(served_model_name=[served_model_name], **server_options), api_keys,
                        clock=clock)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    loop="asyncio", http="h11"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "in-thread server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()
        self.sock.close()

    def __enter__(self) -> "InThreadServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{label="v",...}': value}`` (model_name left out of the key)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_for_metrics(url: str, condition, timeout: float = 10.0) -> dict[str, float]:
    """Scrape until ``condition(values)`` holds; fail with the last scrape after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(url)
        if condition(values):
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics condition not met within {timeout} s: {values}")
        time.sleep(0.05)


def idle(values: dict[str, float]) -> bool:
    return (values["pagedllm:num_requests_running"] == 0 and values["pagedllm:num_requests_waiting"] == 0
            and values["pagedllm:kv_cache_usage_perc"] == 0)


def sse_events(lines: Iterator[str]) -> list:
    """The ``data:`` payloads of an SSE stream: JSON objects, and the final ``"[DONE]"``."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def check_stream_protocol(events: list, n: int, chat: bool) -> tuple[dict[int, str], dict[int, str], dict]:
    """Case B30: every choice's chunks carry finish_reason null until one closing chunk with an
    empty delta; then one usage chunk with ``choices: []``; then ``[DONE]``.

    Returns:
        (finish reason per choice, streamed text per choice, usage).
    """
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] is not None
    finish: dict[int, str] = {}
    texts: dict[int, str] = {i: "" for i in range(n)}
    for chunk in chunks:
        assert chunk["usage"] is None
        for choice in chunk["choices"]:
            index = choice["index"]
            assert index not in finish, f"choice {index} got a chunk after its closing chunk"
            content = (choice["delta"].get("content") or "") if chat else choice["text"]
            if choice["finish_reason"] is None:
                texts[index] += content
            else:
                assert choice["finish_reason"] in ("stop", "length")
                assert (choice["delta"] == {}) if chat else (content == "")
                finish[index] = choice["finish_reason"]
    assert sorted(finish) == list(range(n))
    return finish, texts, usage_chunk["usage"]


def reference_engine() -> LLMEngine:
    return tiny_chat_engine(EngineArgs.from_kwargs(kv_cache_memory_bytes=16 * 2**20,
                                                   max_model_len=MAX_MODEL_LEN, dtype="float32"))


def greedy_alone(engine: LLMEngine, prompt, max_tokens: int, **params) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of ``prompt`` run alone, greedy."""
    with torch_threads(1):
        engine.add_request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
        output = run_to_completion(engine)["ref"].outputs[0]
    return output.text, output.token_ids, output.finish_reason


def chat_prompt(messages: list[dict]) -> dict:
    tokenizer = smollm2_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server_and_reference(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    process = ServerProcess(
        "--served-model-name", MODEL, "other-name",
        "--api-key", API_KEY, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "64", log_path=log_path,
        engine_factory="tests.test_server:tiny_chat_engine")
    try:
        reference = reference_engine()  # built while the server boots
        process.wait_ready()
    except BaseException:
        process.stop()
        raise
    yield process, reference
    assert process.stop() == 0, log_path.read_text()


@pytest.fixture(scope="module")
def server(server_and_reference):
    return server_and_reference[0]


@pytest.fixture(scope="module")
def reference(server_and_reference):
    return server_and_reference[1]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def server_idle_after(request):
    """Every test leaves the shared server idle, so that metric deltas of the next one are its own."""
    yield
    if "server" in request.fixturenames:
        wait_for_metrics(request.getfixturevalue("server").url, idle)


# --------------------------------------------------------------------------------- tests
def test_completions_sync_client_stream_and_not_equal_offline_greedy(client, reference):
    prompt = "The quick brown fox"
    expected_text, expected_ids, _ = greedy_alone(reference, prompt, 12, ignore_eos=True)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected_text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(smollm2_tokenizer().encode(prompt))
    assert response.usage.completion_tokens == 12
    stream = client.completions.create(model="other-name", prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected_text
    assert {c.model for c in chunks} == {MODEL}
    # token-id prompts, and several prompts in one request: choice i is prompt i
    ids = smollm2_tokenizer().encode(prompt)
    batch = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == expected_text
    assert batch.choices[1].text == greedy_alone(reference, {"prompt_token_ids": ids[:2]}, 12, ignore_eos=True)[0]


def test_chat_async_client_stream_and_not_equal_offline_greedy(async_client, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    expected_text, expected_ids, expected_finish = greedy_alone(reference, chat_prompt(messages), 10)

    async def run():
        response = await async_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                              temperature=0)
        stream = await async_client.chat.completions.create(model=MODEL, messages=messages,
                                                            max_completion_tokens=10, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        return response, chunks

    response, chunks = asyncio.run(run())
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text
    assert choice.finish_reason == expected_finish
    assert response.usage.completion_tokens == len(expected_ids)
    assert response.usage.prompt_tokens == len(chat_prompt(messages)["prompt_token_ids"])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text
    assert chunks[-1].choices[0].finish_reason == expected_finish


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_b30_streaming_protocol_with_usage_n2_length(server, endpoint, reference):
    body = {"model": MODEL, "n": 2, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    messages = [{"role": "user", "content": "Count to ten."}]
    if endpoint == "chat":
        body["messages"] = messages
        prompt = chat_prompt(messages)
    else:
        body["prompt"] = "Count to ten:"
        prompt = "Count to ten:"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    with httpx.stream("POST", server.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    finish, texts, usage = check_stream_protocol(events, n=2, chat=endpoint == "chat")
    expected_text, _, _ = greedy_alone(reference, prompt, 10, ignore_eos=True)
    assert finish == {0: "length", 1: "length"}
    assert texts == {0: expected_text, 1: expected_text}
    num_prompt = len(prompt["prompt_token_ids"]) if endpoint == "chat" else len(smollm2_tokenizer().encode(prompt))
    assert usage == {"prompt_tokens": num_prompt, "completion_tokens": 20, "total_tokens": num_prompt + 20}


def test_b01_a_streaming_client_disconnect_aborts(client, server):
    before = scrape(server.url)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on forever."}],
                                            max_tokens=3000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream, start=1):
        if count == 100:
            break
    stream.close()
    after = wait_for_metrics(server.url, lambda v: idle(v) and v['pagedllm:request_success_total{finished_reason="abort"}']
                             == before['pagedllm:request_success_total{finished_reason="abort"}'] + 1)
    generated = after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"]
    assert 99 <= generated < 3000
    time.sleep(0.3)
    assert scrape(server.url)["pagedllm:generation_tokens_total"] == after["pagedllm:generation_tokens_total"]


def test_b01_b_non_streaming_client_killed_aborts(server):
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
    code = ("import httpx, sys; httpx.post(sys.argv[1], json=%r, headers={'Authorization': 'Bearer %s'}, "
            "timeout=600)" % (body, API_KEY))
    client_process = subprocess.Popen([sys.executable, "-c", code, server.url + "/v1/completions"])
    try:
        wait_for_metrics(server.url, lambda v: v["pagedllm:num_requests_running"] == 1, timeout=30)
        time.sleep(1.0)
    finally:
        client_process.kill()
        client_process.wait()
    after = wait_for_metrics(server.url, lambda v: idle(v) and v['pagedllm:request_success_total{finished_reason="abort"}']
                             == before['pagedllm:request_success_total{finished_reason="abort"}'] + 1)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] < 3000
    assert after['pagedllm:request_success_total{finished_reason="length"}'] == \
        before['pagedllm:request_success_total{finished_reason="length"}']


def test_b31_metrics_under_aborts(server, client):
    counters = ["pagedllm:generation_tokens_total", "pagedllm:prompt_tokens_total",
                'pagedllm:request_success_total{finished_reason="abort"}', "pagedllm:num_preemptions_total",
                "pagedllm:time_to_first_token_seconds_count", "pagedllm:e2e_request_latency_seconds_count"]
    gauges = ["pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc"]
    scrapes = [scrape(server.url)]
    stop = threading.Event()

    def keep_scraping():
        while not stop.is_set():
            scrapes.append(scrape(server.url))
            time.sleep(0.02)

    async def read_64_bytes_then_close(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", server.url + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            received = b""
            async for data in response.aiter_raw():
                received += data
                if len(received) >= 64:
                    break

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(read_64_bytes_then_close(http, i) for i in range(5)))

    scraper = threading.Thread(target=keep_scraping)
    scraper.start()
    try:
        asyncio.run(run())
        final = wait_for_metrics(server.url, lambda v: idle(v) and v[counters[2]] == scrapes[0][counters[2]] + 5)
    finally:
        stop.set()
        scraper.join()
    scrapes.append(final)
    for earlier, later in zip(scrapes, scrapes[1:]):
        for name in counters:
            assert later[name] >= earlier[name], name
    for values in scrapes:
        for name in gauges:
            assert values[name] >= 0, name
    time.sleep(0.3)
    assert scrape(server.url)[counters[2]] == scrapes[0][counters[2]] + 5  # counted once each
    # the engine keeps serving
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_50_concurrent_streaming_clients_equal_single_request_greedy(async_client, reference):
    words = ["apple", "river", "engine", "cloud", "paper", "stone", "music", "garden", "window", "tiger"]
    prompts = [f"Request {i}: write about the {words[i % 10]}" + " please" * (i % 7) for i in range(50)]
    expected = [greedy_alone(reference, prompt, 8, ignore_eos=True)[0] for prompt in prompts]

    async def one(prompt: str) -> tuple[str, str]:
        stream = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def run_all() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert {reason for _, reason in results} == {"length"}


def test_b08_prompt_longer_than_max_model_len_over_http(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "other-name"]
    assert {m.model_extra["max_model_len"] for m in models.data} == {MAX_MODEL_LEN}
    tokenizer = smollm2_tokenizer()
    for length in (MAX_MODEL_LEN + 1, 2 * MAX_MODEL_LEN):
        text = " hello" * length
        assert len(tokenizer.encode(text)) == length
        for prompt in (text, [42] * length):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            message = info.value.body["message"]
            assert str(MAX_MODEL_LEN) in message and str(length) in message, message
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
        assert str(MAX_MODEL_LEN) in info.value.body["message"]
    # The limit reported is the one admitted: L - 1 prompt tokens + 1 new token fit, + 2 do not.
    fits = client.completions.create(model=MODEL, prompt=[42] * (MAX_MODEL_LEN - 1), max_tokens=1)
    assert fits.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[42] * (MAX_MODEL_LEN - 1), max_tokens=2)
    assert str(MAX_MODEL_LEN) in info.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens == 2


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, reference):
    """vLLM's ``truncate_prompt_tokens`` (was accepted and ignored): the last k prompt tokens
    run, so a text or token prompt longer than ``max_model_len`` is served, and the answer is
    that of the last k tokens alone; completions and chat; k = 0 or below -1 is a 400."""
    tokenizer = smollm2_tokenizer()
    text = " hello world" * MAX_MODEL_LEN  # 2 x MAX_MODEL_LEN tokens
    ids = tokenizer.encode(text)
    k = 24
    expected = greedy_alone(reference, {"prompt_token_ids": ids[-k:]}, 6, ignore_eos=True)[0]
    for prompt in (text, ids):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True, "truncate_prompt_tokens": k})
        assert response.usage.prompt_tokens == k and response.choices[0].text == expected
    last = client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN - 1})
    assert last.usage.prompt_tokens == MAX_MODEL_LEN - 1
    # -1: what max_model_len leaves after max_tokens (a fresh user's report: it kept
    # max_model_len tokens, which no request can run)
    # echo returns the text that ran, which its logprobs' offsets index (a fresh user's report)
    echo = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=0,
                                     extra_body={"truncate_prompt_tokens": 3})
    assert echo.choices[0].text == tokenizer.decode(ids[-3:]) == "".join(echo.choices[0].logprobs.tokens)
    fill = client.completions.create(model=MODEL, prompt=text, max_tokens=6, extra_body={"truncate_prompt_tokens": -1})
    assert fill.usage.prompt_tokens == MAX_MODEL_LEN - 6 and fill.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=3, extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN})
    assert info.value.body["message"].startswith(f"truncate_prompt_tokens={MAX_MODEL_LEN} kept {MAX_MODEL_LEN} prompt")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3,
                                          extra_body={"truncate_prompt_tokens": k})
    assert chat.usage.prompt_tokens == k
    for bad in (0, -5):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": bad})
        assert info.value.body["param"] == "truncate_prompt_tokens" and str(bad) in info.value.body["message"]


def test_b10_empty_prompt_is_400_and_engine_keeps_serving(server, client):
    assert smollm2_tokenizer().encode("") == []
    for prompt in ("", []):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert "empty" in info.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="next", max_tokens=3).usage.completion_tokens == 3


def hf_prompt_logprobs(token_ids: list[int]) -> torch.Tensor:
    """Reference: transformers' Llama with the tiny weights; logprob of each prompt token
    after the first, given the ones before it."""
    logprobs = hf_logprobs(token_ids)
    return logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]


def hf_logprobs(token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` float32 log-softmax of transformers' Llama with the tiny
    weights: row i is the distribution of the token after ``token_ids[: i + 1]``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = tiny_chat_config()
    hf_config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                            max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    model = LlamaForCausalLM(hf_config).float().eval()
    model.load_state_dict(tiny_state_dict(c), strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_b11_echo_with_max_tokens_0_returns_prompt(client):
    prompt = "Echo this prompt back"
    tokenizer = smollm2_tokenizer()
    prompt_ids = tokenizer.encode(prompt)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 0 and plain.usage.prompt_tokens == len(prompt_ids)
    with_logprobs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = with_logprobs.choices[0]
    assert choice.text == prompt
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = hf_prompt_logprobs(prompt_ids)
    assert torch.allclose(torch.tensor(logprobs.token_logprobs[1:]), expected, atol=1e-4)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0
    # the same through streaming: one chunk carries the echoed prompt
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == prompt


def test_prompt_logprobs_are_returned_as_vllm_does(server):
    """``prompt_logprobs: k`` (vLLM's extension): each choice carries ``prompt_logprobs``, None
    for the first prompt token, then the token's own logprob (transformers' value) and up to k
    alternatives, keyed by token id; a chat response has it at the top level."""
    prompt = "Echo this prompt back"
    prompt_ids = smollm2_tokenizer().encode(prompt)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = httpx.post(server.url + "/v1/completions", headers=headers,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    expected = hf_prompt_logprobs(prompt_ids)
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], entries[1:])):
        assert 1 <= len(entry) <= 3 and abs(entry[str(token_id)]["logprob"] - float(expected[position])) < 1e-4
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(token_id)])
    plain = httpx.post(server.url + "/v1/completions", headers=headers,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = httpx.post(server.url + "/v1/chat/completions", headers=headers,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                            "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize("max_tokens", [-1, 1.5, "many"])
def test_b11_bad_max_tokens_is_400_naming_the_field(server, max_tokens):
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "max_tokens" in error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"


def test_port_in_use_is_refused_before_loading_the_model():
    from pagedllm.utils import check_port_free

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again


@pytest.mark.parametrize("message,needle", [({"role": "wizard", "content": "x"}, "role"),
                                             ({"role": "user"}, "content")])
def test_invalid_chat_message_is_400(server, message, needle):
    response = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": [message], "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "BadRequestError"


def test_errors_are_openai_json(server, client):
    wrong_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    # The scheme is case-insensitive (RFC 7235), the key is not; anything else is a 401.
    for header, status in [(f"bearer {API_KEY}", 200), (f"BEARER {API_KEY}", 200), (f"Bearer {API_KEY.upper()}", 401),
                           (f"Basic {API_KEY}", 401), (f"Bearer{API_KEY}", 401), (API_KEY, 401), ("Bearer", 401)]:
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": header}).status_code == status, header
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert "temperature" in info.value.body["message"] and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=65)
    assert "max_num_seqs" in info.value.body["message"]
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    # open endpoints need no key
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": __import__("pagedllm").__version__}


def test_tokenize_and_detokenize(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokenizer = smollm2_tokenizer()
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    assert tokens == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": tokenizer.encode("Hello world")}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=headers).json()
    assert chat["tokens"] == chat_prompt(messages)["prompt_token_ids"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text == {"prompt": "Hello world"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, headers=headers)
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def test_chat_logprobs_equal_transformers(client, reference):
    messages = [{"role": "user", "content": "Say something."}]
    prompt = chat_prompt(messages)
    _, expected_ids, _ = greedy_alone(reference, prompt, 5, ignore_eos=True)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    reference_logprobs = hf_logprobs(prompt["prompt_token_ids"] + expected_ids)
    num_prompt = len(prompt["prompt_token_ids"])
    tokenizer = smollm2_tokenizer()
    for position, (entry, token_id) in enumerate(zip(content, expected_ids, strict=True)):
        row = reference_logprobs[num_prompt - 1 + position]
        assert entry.token == tokenizer.decode([token_id])
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        top_values, top_ids = row.topk(2)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    # the second run reads the prompt's KV from the prefix cache: equal up to float rounding
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_stop_string_over_http_stream_and_not(client, reference):
    prompt = "The quick brown fox"
    full, _, _ = greedy_alone(reference, prompt, 12, ignore_eos=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected_text, _, expected_finish = greedy_alone(reference, prompt, 12, ignore_eos=True, stop=[stop])
    assert expected_finish == "stop" and expected_text == full[:full.index(stop)]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected_text, "stop", stop)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == expected_text


@pytest.mark.parametrize("port", [-1, 65536, 99999])
def test_port_out_of_range_is_a_clear_error_before_loading(port):
    """Found by the fresh-user check: --port 99999 loaded the model, then died in uvicorn
    with an OverflowError traceback."""
    from pagedllm.utils import check_port_free
    with pytest.raises(ValueError, match=rf"--port must be in \[0, 65535\], got {port}"):
        check_port_free("127.0.0.1", port)
