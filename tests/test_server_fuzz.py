"""Schema fuzz of the HTTP API: schemathesis generates requests from the app's own OpenAPI
schema (valid ones and ones that break it) and sends them in-process, to the ASGI app over the
tiny random llama with SmolLM2's tokenizer (so text prompts and chat templates are real).

Whatever comes in, the server answers no 5xx, every error is OpenAI's JSON
(``{"error": {"message", "type", "param", "code"}}``) and a streamed error is no 5xx either;
afterwards the engine serves a normal request and every KV block is back. Examples are
derandomized and bounded, so a run is the same run every time (~20 s on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from pagedllm.metrics import EngineMetrics
from tests.test_server import MODEL, smollm2_tokenizer, tiny_chat_engine

MAX_EXAMPLES = 60  # per operation and generation mode


@pytest.fixture(scope="module")
def fuzzed_engine():
    smollm2_tokenizer()
    args = EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=16,
                                  max_num_batched_tokens=64)
    engine = tiny_chat_engine(args)
    metrics = EngineMetrics(MODEL, engine.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    async_engine = AsyncLLMEngine(engine, metrics)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def app(fuzzed_engine):
    return build_app(fuzzed_engine, ServerArgs(served_model_name=[MODEL]))


def assert_openai_error_body(body: object, status: int) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"].endswith("Error"), error
    assert error["param"] is None or isinstance(error["param"], str), error


def check_response(status: int, content_type: str, text: str) -> None:
    """No 5xx; errors as OpenAI's JSON; a stream ends with [DONE] and carries no 5xx event."""
    assert status < 500, f"{status}: {text[:2000]}"
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        assert_openai_error_body(json.loads(text), status)
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-2000:]
        for event in map(json.loads, events[:-1]):
            if "error" in event:
                assert_openai_error_body(event, event["error"]["code"])
                assert event["error"]["code"] < 500, event


def served_and_well_formed(case):
    """A positive case made to reach the engine: generated bodies name random models and chat
    messages without content (the schema allows both; the server answers 404 / 400)."""
    if isinstance(case.body, dict):
        case.body.pop("model", None)
        if isinstance(case.body.get("messages"), list):
            case.body["messages"] = [{"role": "user", "content": message.get("content") or "hi"}
                                     if isinstance(message, dict) else message
                                     for message in case.body["messages"]]
    return case


@pytest.mark.parametrize("mode, reach_engine", [(GenerationMode.POSITIVE, False), (GenerationMode.NEGATIVE, False),
                                                (GenerationMode.POSITIVE, True)],
                         ids=["positive", "negative", "positive-reaching-the-engine"])
def test_fuzzed_requests_get_no_5xx_and_only_openai_error_json(app, mode, reach_engine):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # Read every stream to its end (schemathesis stops after 100 events by default): at most
    # n=16 choices of 128 tokens.
    schema.config.max_stream_events = 10_000
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} >= {"/v1/completions", "/v1/chat/completions",
                                                            "/tokenize", "/detokenize"}
    statuses = []
    for operation in operations:
        inputs = (operation.body, operation.query, operation.path_parameters, operation.headers, operation.cookies)
        if mode is GenerationMode.NEGATIVE and not any(map(len, inputs)):
            continue  # nothing to break in GET /health
        if reach_engine and operation.path not in ("/v1/completions", "/v1/chat/completions"):
            continue
        strategy = operation.as_strategy(mode)
        if reach_engine:
            strategy = strategy.map(served_and_well_formed)

        @given(case=strategy)
        @settings(max_examples=MAX_EXAMPLES * (2 if reach_engine else 1), derandomize=True, deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call()
            statuses.append(response.status_code)
            try:
                check_response(response.status_code, response.headers.get("content-type", [""])[0],
                               response.text)
            except AssertionError as exc:
                raise AssertionError(f"{operation.method.upper()} {operation.path} with body "
                                     f"{getattr(case, 'body', None)!r}: {exc}") from exc
        try:
            fuzz()
        except Unsatisfiable:
            # Nothing invalid to send: GET /v1/models/{model_id} takes any string as an id.
            assert mode is GenerationMode.NEGATIVE and not any(map(len, inputs[:2])), operation.path
    if reach_engine:  # the fuzz did generate text, not only refusals
        assert statuses.count(200) >= MAX_EXAMPLES // 2, statuses


def test_engine_serves_a_normal_request_after_the_fuzz(app, fuzzed_engine):
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                        "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert client.get("/health").status_code == 200
    assert fuzzed_engine.is_healthy and fuzzed_engine.num_open_requests == 0
    pool = fuzzed_engine.engine.kv_cache_manager.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
