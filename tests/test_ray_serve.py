"""Scale-out on Ray Serve (``pagedllm/serve_ray/``): ``pagedllm serve --replicas 2`` as a real
process on loopback, each replica one thread over the tiny random llama with SmolLM2's
tokenizer, driven by the official ``openai`` client and raw HTTP; then the pieces alone
(prefix keys, the router's policy, the remote stream's retry and abort, the replica plan), and
the KubeRay ``RayService`` sample.

One Ray cluster serves the whole module (starting it costs most of this file's time); the test
that kills a replica runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from pagedllm.engine.async_engine import EngineDrainingError, QueueFullError
from pagedllm.engine.stats import ModelInfo
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import parse_serve_args
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, to_openai_error
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.serve_ray.app import app_builder
from pagedllm.serve_ray.engine_client import RayEngineClient, RemoteRequestStream, ReplicaLostError
from pagedllm.serve_ray.options import ReplicaPlan
from pagedllm.serve_ray.prefix_index import PrefixIndex, prefix_block_hashes
from pagedllm.serve_ray.router import PrefixAwareRequestRouter
from tests.test_server import (API_KEY, MODEL, ServerProcess, greedy_alone, reference_engine, slowed,
                               smollm2_tokenizer, sse_events, tiny_chat_engine, wait_for_metrics)

REPO_ROOT = Path(__file__).resolve().parent.parent
LIMITED_KEY = "limited-key"
STEP_SECONDS = 0.01  # each replica step sleeps this long, so that requests stay in flight


def slow_tiny_chat_engine(engine_args):
    """The replicas' engine factory: the server tests' tiny chat engine, each step at
    least ``STEP_SECONDS``."""
    return slowed(tiny_chat_engine(engine_args), STEP_SECONDS)


# --------------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("ray") / "serve.log"
    keys = [{"name": "test", "key": API_KEY}, {"name": "limited", "key": LIMITED_KEY, "requests_per_minute": 1}]
    os.environ["PAGEDLLM_API_KEYS"] = json.dumps(keys)  # read by the child at start only
    try:
        process = ServerProcess(
            "--replicas", "2", "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "4096",
            "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "16", log_path=log_path,
            engine_factory="tests.test_ray_serve:slow_tiny_chat_engine")
    finally:
        del os.environ["PAGEDLLM_API_KEYS"]
    try:
        process.wait_ready()
        wait_for_replicas(process.url, 2)
    except BaseException:
        process.stop()
        raise
    yield process
    assert process.stop(timeout=60) == 0, log_path.read_text()[-5000:]


@pytest.fixture(scope="module")
def reference():
    return reference_engine()


def replicas(url: str) -> dict[str, dict]:
    return httpx.get(url + "/load", timeout=10).json().get("replicas", {})


def wait_for_replicas(url: str, count: int, condition=lambda reports: True, timeout: float = 120.0) -> dict:
    """``/load``'s replica reports once ``count`` healthy replicas answer and ``condition`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        reports = replicas(url)
        healthy = {r: report for r, report in reports.items() if report["healthy"]}
        if len(healthy) == count and condition(healthy):
            return healthy
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count} replicas meeting the condition within {timeout} s: {reports}")
        time.sleep(0.2)


def idle_since(moment: float):
    """A condition: every replica reported after ``moment`` (``time.time()``) and is idle."""
    def condition(reports: dict) -> bool:
        return all(r["time"] > moment and r["running"] == 0 and r["waiting"] == 0 and r["num_used_blocks"] == 0
                   for r in reports.values())
    return condition


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


# --------------------------------------------------------------------------------- end to end
def test_openai_client_stream_and_not_equal_offline_greedy(ray_server, reference):
    prompt = "The quick brown fox"
    expected, _, _ = greedy_alone(reference, prompt, 12, ignore_eos=True)
    api = client(ray_server.url)
    response = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected
    assert response.usage.prompt_tokens == len(smollm2_tokenizer().encode(prompt))
    assert response.usage.completion_tokens == 12
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12
    messages = [{"role": "user", "content": "Name a color."}]
    tokenizer = smollm2_tokenizer()
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    expected_chat, _, _ = greedy_alone(reference, {"prompt_token_ids": chat_ids}, 10)
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == expected_chat
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected_chat
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert httpx.get(ray_server.url + "/health").status_code == 200
    # /metrics: every replica's engine series, labelled by replica; the request counters and
    # histograms over both replicas count the 4 requests above (as of the replicas' next report).
    generated = 2 * 12 + 2 * chat.usage.completion_tokens  # the chat stream is the same greedy reply

    def total(values: dict, name: str) -> float:
        return sum(v for key, v in values.items() if key.split("{")[0] == name)

    values = wait_for_metrics(ray_server.url, lambda v: total(v, "pagedllm:e2e_request_latency_seconds_count") == 4)
    assert total(values, "pagedllm:request_success_total") == 4
    assert total(values, "pagedllm:generation_tokens_total") == generated
    replica_ids = set(replicas(ray_server.url))
    for name in ("vllm:num_requests_waiting", "pagedllm:time_to_first_token_seconds_count"):
        assert {key.split('replica="')[1].split('"')[0] for key in values if key.split("{")[0] == name} == replica_ids
    assert values["pagedllm:num_replicas"] == 2
    # 2 replicas on C cores: C // 2 torch threads each, never more than the machine has.
    cores = len(os.sched_getaffinity(0))
    assert [r["num_threads"] for r in replicas(ray_server.url).values()] == [max(1, cores // 2)] * 2


def test_api_keys_and_rate_limits_as_on_one_server(ray_server):
    with pytest.raises(openai.AuthenticationError):
        client(ray_server.url, "wrong").completions.create(model=MODEL, prompt="hi", max_tokens=1)
    limited = client(ray_server.url, LIMITED_KEY)
    limited.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.NotFoundError):
        client(ray_server.url).completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(ray_server.url).completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=-1)


def test_shared_prefix_lands_on_one_replica_unrelated_load_spreads(ray_server):
    url = ray_server.url
    before = wait_for_replicas(url, 2, idle_since(time.time()))
    api = client(url)
    system = "You answer questions about the weather in great detail. " * 12  # about 130 tokens: 8 blocks
    for user in range(6):
        api.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"Question {user}: rain?"}])
    after = wait_for_replicas(url, 2, idle_since(time.time()))
    queried = {r: after[r]["prefix_cache_queries"] - before[r]["prefix_cache_queries"] for r in before}
    hits = {r: after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in before}
    holder = max(queried, key=queried.get)
    assert [v for r, v in queried.items() if r != holder] == [0], queried  # all six on one replica
    assert hits[holder] >= 5 * 128, hits  # the five after the first found the system prompt's blocks

    # Unrelated prompts (token ids without a shared block), 8 at once: both replicas take some.
    async def burst():
        async_api = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        await asyncio.gather(*(async_api.completions.create(
            model=MODEL, prompt=[1000 + 37 * i + j for j in range(40)], max_tokens=30,
            extra_body={"ignore_eos": True}) for i in range(8)))
    asyncio.run(burst())
    spread = wait_for_replicas(url, 2, idle_since(time.time()))
    new_queries = {r: spread[r]["prefix_cache_queries"] - after[r]["prefix_cache_queries"] for r in after}
    assert all(v >= 40 for v in new_queries.values()), new_queries


def test_client_disconnect_frees_blocks_on_the_replica(ray_server):
    url = ray_server.url
    wait_for_replicas(url, 2, idle_since(time.time()))
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
            busy = wait_for_replicas(url, 2, lambda rs: any(r["num_used_blocks"] > 0 for r in rs.values()))
            assert sum(r["running"] for r in busy.values()) == 1
        disconnected = time.monotonic()
    # 2000 tokens at >= 10 ms a step would run 20 s more; the abort frees the blocks at once.
    wait_for_replicas(url, 2, idle_since(time.time()), timeout=10)
    assert time.monotonic() - disconnected < 10
    # A non-streaming request whose client gives up is aborted as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=2),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    gave_up = time.monotonic()
    wait_for_replicas(url, 2, idle_since(time.time()), timeout=10)
    assert time.monotonic() - gave_up < 10


def test_killed_replica_ends_its_stream_with_an_error_and_is_replaced(ray_server):
    url = ray_server.url
    before = wait_for_replicas(url, 2, idle_since(time.time()))
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            lines = response.iter_lines()
            first = [next(lines) for _ in range(3)]
            busy = wait_for_replicas(url, 2, lambda rs: any(r["running"] == 1 for r in rs.values()))
            victim = next(r for r, report in busy.items() if report["running"] == 1)
            os.kill(busy[victim]["pid"], signal.SIGKILL)
            killed = time.monotonic()
            events = sse_events([*first, *lines])  # ends: no hang
    assert time.monotonic() - killed < 30
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and "replica serving this request was lost after" in error["message"], error
    assert "pid" not in error["message"] and "Actor" not in error["message"]  # Ray internals stay in the log
    # New requests go to the healthy replica (or the replacement) and succeed.
    api = client(url)
    for i in range(4):
        response = api.completions.create(model=MODEL, prompt=f"After the crash {i}", max_tokens=3)
        assert response.choices[0].finish_reason in ("length", "stop")
    # Serve replaces the killed replica.
    after = wait_for_replicas(url, 2, lambda rs: victim not in rs, timeout=150)
    assert {r["pid"] for r in after.values()}.isdisjoint({before[victim]["pid"]})


# --------------------------------------------------------------------------------- the pieces
def test_prefix_keys_chain_and_salt():
    a = prefix_block_hashes(list(range(40)), 16)
    b = prefix_block_hashes(list(range(32)) + [7] * 8, 16)
    assert len(a) == 2 and a == b  # two full blocks, equal; the partial third has no key
    c = prefix_block_hashes([99] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later key
    assert prefix_block_hashes(list(range(40)), 16, cache_salt="s") != a
    assert all(0 <= key < 2**63 for key in a)
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1], 0)


def test_prefix_index_is_a_bounded_lru():
    index = PrefixIndex(3)
    index.add([1, 2, 3])
    index.add([1])  # 1 becomes the most recent
    index.add([4])  # evicts 2
    assert index.keys() == [3, 1, 4] and len(index) == 3
    assert index.match([1, 2, 3]) == 1 and index.match([3, 1, 4, 5]) == 3


class FakeReplica:
    """What the router reads of a ``RunningReplica``."""

    def __init__(self, name: str, routing_stats: dict) -> None:
        self.replica_id = ReplicaID(name, DeploymentID(name="EngineReplica", app_name="pagedllm"))
        self.routing_stats = routing_stats
        self.max_ongoing_requests = 32


class FakePending:
    def __init__(self, keys) -> None:
        self.kwargs = {"prefix_hashes": tuple(keys)}


def make_router() -> PrefixAwareRequestRouter:
    router = PrefixAwareRequestRouter(DeploymentID(name="EngineReplica", app_name="pagedllm"),
                                      DeploymentHandleSource.UNKNOWN)
    router.initialize_state(max_imbalance=2, kv_usage_limit=0.9)
    return router


def test_router_prefers_the_prefix_holder_unless_overloaded():
    keys = prefix_block_hashes(list(range(64)), 16)
    holder = FakeReplica("a", {"prefix_hashes": keys[:3], "waiting": 0, "kv_cache_usage": 0.1})
    other = FakeReplica("b", {"prefix_hashes": [], "waiting": 0, "kv_cache_usage": 0.1})
    router = make_router()
    choose = lambda: asyncio.run(router.choose_replicas([other, holder], FakePending(keys)))  # noqa: E731
    assert choose()[0] == [holder]
    # Waiting queue 3 above the other's (limit 2): the least loaded instead.
    holder.routing_stats["waiting"] = 3
    assert choose() == [[other]]
    holder.routing_stats["waiting"] = 0
    # A full KV cache while the other has room: the other.
    holder.routing_stats["kv_cache_usage"] = 0.95
    assert choose() == [[other]]
    holder.routing_stats["kv_cache_usage"] = 0.1
    # What the router sent counts before any report: b takes a new prefix, then keeps it.
    new_keys = prefix_block_hashes(list(range(100, 164)), 16)
    router.on_request_routed(FakePending(new_keys), other.replica_id, None)
    assert asyncio.run(router.choose_replicas([other, holder], FakePending(new_keys)))[0] == [other]
    # ... with 2 more in flight than a (limit 2), and no longer with 3.
    router.on_request_routed(FakePending([]), other.replica_id, None)
    assert asyncio.run(router.choose_replicas([other, holder], FakePending(new_keys)))[0] == [other]
    router.on_request_routed(FakePending([]), other.replica_id, None)
    assert asyncio.run(router.choose_replicas([other, holder], FakePending(new_keys))) == [[holder]]
    assert router.decisions["prefix"] >= 2 and router.decisions["overloaded"] == 3


class FakeGenerator:
    """A Serve streaming response: ``items`` (an exception is raised), then the end."""

    def __init__(self, items) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self):
        if self.cancelled:
            raise asyncio.CancelledError()
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, text, [5] * len(text),
                                                             "length" if finished else None)], finished)


def remote_stream(generator, resubmit=None, ended=None) -> RemoteRequestStream:
    async def no_resubmit():
        raise AssertionError("resubmitted")
    return RemoteRequestStream("r", generator, resubmit or no_resubmit, "p", [1, 2], 1, 1,
                               lambda: ended.append("end") if ended is not None else None)


async def read_all(stream) -> list:
    return [item async for item in stream]


def test_remote_stream_retries_a_lost_replica_only_before_output():
    second = FakeGenerator([output("a"), output("ab", True)])

    async def resubmit():
        return second
    ended = []
    stream = remote_stream(FakeGenerator([ActorDiedError()]), resubmit, ended)
    assert [o.outputs[0].text for o in asyncio.run(read_all(stream))] == ["a", "ab"]
    assert ended == ["end"]
    stream = remote_stream(FakeGenerator([output("a"), ActorDiedError()]))
    with pytest.raises(ReplicaLostError, match="lost after 1 generated token") as raised:
        asyncio.run(read_all(stream))
    assert "Actor" not in str(raised.value) and "pid" not in str(raised.value)  # no Ray internals
    # A non-streaming reader (final_only) showed its client nothing: retried after partial output,
    # the final output is the new replica's alone.
    ended = []
    stream = remote_stream(FakeGenerator([output("x"), output("xy"), ActorDiedError()]),
                           lambda: asyncio.sleep(0, FakeGenerator([output("a"), output("ab", True)])), ended)
    stream.final_only = True
    assert [o.outputs[0].text for o in asyncio.run(read_all(stream))] == ["x", "xy", "a", "ab"]
    assert stream.last_output.outputs[0].text == "ab" and ended == ["end"]
    # Lost again with no retries left: a clear error.
    stream = remote_stream(FakeGenerator([output("x"), ActorDiedError()]),
                           lambda: asyncio.sleep(0, FakeGenerator([ActorDiedError()])))
    stream.final_only = True
    with pytest.raises(ReplicaLostError, match="lost with no retries left"):
        asyncio.run(read_all(stream))
    # The replica's own exception, out of Ray's wrapper: the routes map it as on one server (429 here).
    wrapped = RayTaskError("generate", "traceback", QueueFullError("8 sequences are waiting")).as_instanceof_cause()
    stream = remote_stream(FakeGenerator([wrapped]))
    with pytest.raises(QueueFullError) as raised:
        asyncio.run(read_all(stream))
    assert type(raised.value) is QueueFullError and str(raised.value) == "8 sequences are waiting"


def test_drain_refuses_new_requests_and_waits_for_open_ones():
    """``pagedllm serve --replicas`` on SIGTERM: the ingress's client refuses new requests (503
    with Retry-After, /readyz false) and waits for the open ones, up to the drain timeout."""
    from pagedllm.sampling_params import SamplingParams

    client = RayEngineClient.__new__(RayEngineClient)  # no Ray needed for the drain itself
    client.draining, client._num_open = False, 2

    async def scenario():
        async def finish():
            await asyncio.sleep(0.2)
            client._num_open = 0
        task = asyncio.ensure_future(finish())
        assert await client.drain(5.0, poll=0.01) == 0 and client.draining
        await task
        with pytest.raises(EngineDrainingError, match="shutting down"):
            await client.add_request("r", "p", SamplingParams())
        client._num_open = 1
        start = time.monotonic()
        assert await client.drain(0.1, poll=0.01) == 1 and time.monotonic() - start < 1.0
    asyncio.run(scenario())
    error = to_openai_error(EngineDrainingError("the server is shutting down"))
    assert error.status == 503 and error.headers["Retry-After"] == "1"


def test_remote_stream_abort_and_close_cancel_the_replica_call():
    generator = FakeGenerator([output("a"), output("ab"), output("abc", True)])
    stream = remote_stream(generator)

    async def first_then_abort():
        first = await stream.__anext__()
        stream.abort()
        return first, [o async for o in stream]
    first, rest = asyncio.run(first_then_abort())
    assert generator.cancelled and first.outputs[0].text == "a"
    assert len(rest) == 1 and rest[0].finished and rest[0].outputs[0].finish_reason == "abort"
    assert rest[0].outputs[0].text == "a"
    generator = FakeGenerator([output("a")])
    stream = remote_stream(generator)
    stream.close()
    assert generator.cancelled and stream.finished


def report(waiting: int, wait_s) -> dict:
    return {"healthy": True, "running": 16, "waiting": waiting, "num_blocks": 64, "num_used_blocks": 60,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0, "step_time_s": 0.05,
            "finish_rate": 1.0, "estimated_wait_s": wait_s, "kv_cache_usage": 0.9, "prefix_hashes": []}


class DummyHandle:
    def options(self, **kwargs):
        return self


def test_overload_503_only_when_every_replica_is_overloaded():
    info = ModelInfo(model=None, max_model_len=128, vocab_size=256, eos_token_id=None, tokenizer=None,
                     block_size=16, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=64)
    engine = RayEngineClient(DummyHandle(), info, MODEL, "pagedllm", "EngineReplica", request_timeout=5.0)
    serving = OpenAIServing(engine, [MODEL])
    engine.update_reports({"a": report(20, 21.0), "b": report(0, 0.05)})
    serving.check_overload(0)  # b can start it at once
    assert engine.stats.num_waiting_reqs == 0
    engine.update_reports({"a": report(20, 21.0), "b": report(30, 31.0)})
    with pytest.raises(OpenAIError) as refused:
        serving.check_overload(0)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "16"


def test_replica_plan_threads_and_autoscaling_options():
    def plan_of(*argv: str, cores: int) -> ReplicaPlan:
        server_args, engine_args = parse_serve_args(build_parser().parse_args(["serve", *argv]))
        return ReplicaPlan.from_args(server_args, engine_args.max_num_seqs, cores)

    plan = plan_of("--replicas", "2", cores=2)
    assert (plan.min_replicas, plan.max_replicas, plan.threads, plan.target_ongoing_requests) == (2, 2, 1, None)
    plan = plan_of("--replicas", "1", "--max-replicas", "4", "--max-num-seqs", "8", cores=16)
    assert (plan.min_replicas, plan.max_replicas, plan.threads, plan.target_ongoing_requests) == (1, 4, 4, 8)
    assert plan_of("--replicas", "3", cores=2).threads == 1
    with pytest.raises(ValueError, match="--max-replicas must be >= --replicas"):
        plan_of("--replicas", "3", "--max-replicas", "2", cores=2)
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        plan_of("--replicas", "0", cores=2)
    # `serve run pagedllm.serve_ray.app:app_builder key=value ...` parses the same options.
    app = app_builder({"replicas": "1", "max-replicas": "3", "max_num_seqs": "8", "threads-per-replica": "1"})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    autoscaling = engine._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 3, 8)
    assert engine.ray_actor_options["num_cpus"] == 1
    assert engine.ray_actor_options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert engine._deployment_config.request_router_config.request_router_class.endswith("PrefixAwareRequestRouter")
    with pytest.raises(ValueError, match="bad app_builder arguments"):
        app_builder({"no-such-option": "1"})
    # `serve build pagedllm.serve_ray.default_app:app` needs an Application object.
    from pagedllm.serve_ray.default_app import app as default_app
    assert default_app._bound_deployment.init_args[0]._bound_deployment.num_replicas == 1


# --------------------------------------------------------------------------------- KubeRay
def _object(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
_POD_TEMPLATE = {"type": "object"}  # validated separately, strictly, as a Kubernetes PodTemplate
# The part of KubeRay's RayService CRD (ray.io/v1, ray-operator/config/crd/bases/ray.io_rayservices.yaml)
# that the sample uses, written from it: field names, types and required fields as the CRD has them.
# Unknown fields are refused here (the CRD's structural schema would prune them silently).
RAYSERVICE_SCHEMA = _object({
    "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayService"},
    "metadata": _object({"name": {"type": "string"}, "labels": _STRING_MAP}, ("name",)),
    "spec": _object({
        "serveConfigV2": {"type": "string"},
        "rayClusterConfig": _object({
            "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
            "headGroupSpec": _object({"rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE}, ("template",)),
            "workerGroupSpecs": {"type": "array", "items": _object({
                "groupName": {"type": "string"}, "replicas": _INT32, "minReplicas": _INT32,
                "maxReplicas": _INT32, "rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE},
                ("groupName", "maxReplicas", "minReplicas", "template"))},
        }, ("headGroupSpec",)),
    }, ("rayClusterConfig",)),
}, ("apiVersion", "kind", "metadata", "spec"))


def test_rayservice_sample_renders_validates_and_builds_the_app():
    import jsonschema
    import kubernetes_validate

    from tests.test_kubernetes import kubectl

    result = subprocess.run([kubectl(), "kustomize", str(REPO_ROOT / "deploy" / "kubernetes" / "ray")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (service,) = [d for d in yaml.safe_load_all(result.stdout) if d]
    jsonschema.validate(service, RAYSERVICE_SCHEMA)
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:  # every pod template against Kubernetes' own schema, strictly
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": group["template"]}, "1.37.0", strict=True)
    assert cluster["rayVersion"] == __import__("ray").__version__
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    assert application["import_path"] == "pagedllm.serve_ray.app:app_builder"
    args = application["args"]
    # One engine replica per worker pod: its threads are the pod's Ray CPUs and CPU limit.
    (workers,) = cluster["workerGroupSpecs"]
    container = workers["template"]["spec"]["containers"][0]
    assert str(args["threads-per-replica"]) == workers["rayStartParams"]["num-cpus"] == \
        container["resources"]["limits"]["cpu"]
    assert workers["minReplicas"] <= args["replicas"] <= args["max-replicas"] <= workers["maxReplicas"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no engine on the head
    # The builder accepts exactly these arguments (offline: no Ray cluster is needed to build).
    app = app_builder(args)
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.ray_actor_options["num_cpus"] == args["threads-per-replica"]
    assert engine._deployment_config.autoscaling_config.max_replicas == args["max-replicas"]
