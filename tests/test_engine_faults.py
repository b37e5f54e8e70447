"""Faults the engine must survive: an abort racing a resubmission of the same request id, and
an exception inside the model forward (injected here). In both, only the request the fault
belongs to may end; every other one, and the engine, go on, and no KV block leaks."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import httpx
import pytest

from pagedllm.engine import async_engine
from pagedllm.engine.async_engine import AsyncLLMEngine, RequestFailedError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import model_runner
from tests.conftest import make_tiny_engine, run_to_completion
from tests.test_server import InThreadServer, idle, slowed, sse_events, wait_for_metrics

GREEDY = dict(temperature=0.0, ignore_eos=True)
ERROR = 'pagedllm:request_success_total{finished_reason="error"}'


def greedy_alone(prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_tiny_engine()
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return run_to_completion(engine)["ref"].outputs[0].token_ids


def assert_pool_consistent(engine: LLMEngine) -> None:
    pool = engine.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def fail_forward_once(engine: LLMEngine, when, after_forward: bool = False) -> list:
    """Make the model runner raise in the first step for which ``when(batch.requests)`` holds;
    with ``after_forward``, after the real forward wrote its K/V (the worst case: blocks hold
    half a step's work). Returns the list of failures (one entry per injected raise)."""
    execute_model = engine.model_runner.execute_model
    failures = []

    def faulty(batch):
        if not failures and when(batch.requests):
            failures.append([request.request_id for request in batch.requests])
            if after_forward:
                execute_model(batch)
            raise RuntimeError("injected forward fault")
        return execute_model(batch)
    engine.model_runner.execute_model = faulty
    return failures


# --------------------------------------------------------------------------------- abort race
def test_abort_then_resubmit_same_id_only_aborts_the_old_instance():
    """Closing request x's stream and at once adding a new x: the old instance's abort (and
    its final "abort" output) must reach only the old instance; the new x runs to its end."""
    prompt, max_tokens = [5, 6, 7], 12
    expected = greedy_alone(prompt, max_tokens)
    engine = AsyncLLMEngine(slowed(make_tiny_engine(), 0.002))
    engine.start()
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)

    async def race() -> list:
        finals = []
        for _ in range(8):
            old = await engine.add_request("x", prompt, params)
            assert not (await old.__anext__()).finished  # the old x is running
            old.close()
            new = await engine.add_request("x", prompt, params)
            outputs = [output async for output in new]
            finals.append(outputs[-1])
        return finals

    try:
        finals = asyncio.run(race())
        assert engine.is_healthy
    finally:
        engine.shutdown()
    assert [final.request_id for final in finals] == ["x"] * 8
    assert [final.outputs[0].finish_reason for final in finals] == ["length"] * 8
    assert all(final.outputs[0].token_ids == expected for final in finals)
    assert engine._entries == {} and engine._active == {}
    assert engine.engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_engine_abort_by_user_id_ends_only_the_open_instance():
    engine = AsyncLLMEngine(slowed(make_tiny_engine(), 0.002))
    engine.start()
    params = SamplingParams(max_tokens=40, **GREEDY)

    async def run() -> tuple:
        first = await engine.add_request("y", [1, 2], params)
        engine.abort("y")
        outputs = [output async for output in first]
        engine.abort("y")  # nothing open under "y" now: ignored, and no later "y" is touched
        second = await engine.add_request("y", [1, 2], SamplingParams(max_tokens=3, **GREEDY))
        return outputs[-1], [output async for output in second][-1]

    try:
        aborted, completed = asyncio.run(run())
    finally:
        engine.shutdown()
    assert aborted.outputs[0].finish_reason == "abort"
    assert completed.outputs[0].finish_reason == "length" and len(completed.outputs[0].token_ids) == 3


# --------------------------------------------------------------------------------- model faults
@pytest.mark.parametrize("after_forward", [False, True])
def test_model_forward_exception_ends_only_that_steps_requests(after_forward):
    """max_num_seqs=3 keeps c waiting while a (n=1) and b (n=2, its second sample a pending
    fork) run; the forward of a step with both fails: a and b end with "error", all their
    blocks come back, and c, then a resubmitted a, complete exactly as if alone (a
    half-written block is never offered by the prefix cache)."""
    engine = make_tiny_engine(max_num_seqs=3)
    failures = fail_forward_once(engine, lambda scheduled: len(scheduled) == 2, after_forward)
    prompt_a, prompt_b, prompt_c = list(range(1, 11)), [9, 8, 7, 6, 5], [3, 1, 4, 1, 5]
    engine.add_request("a", prompt_a, SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("b", prompt_b, SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=1))
    engine.add_request("c", prompt_c, SamplingParams(max_tokens=6, **GREEDY))
    outputs = engine.step()
    assert len(failures) == 1 and len(failures[0]) == 2 and failures[0][0] == "a"  # and b's first sample
    finals = {output.request_id: output for output in outputs}
    assert sorted(finals) == ["a", "b"]
    for output in finals.values():
        assert output.finished and output.error == "the model forward failed: RuntimeError: injected forward fault"
        assert [completion.finish_reason for completion in output.outputs] == ["error"] * len(output.outputs)
    assert len(finals["b"].outputs) == 2
    assert_pool_consistent(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    assert [request.request_id for request in engine.scheduler.waiting] == ["c"]
    assert engine.scheduler.running == [] and sorted(engine.scheduler.requests) == ["c"]

    engine.add_request("a", prompt_a, SamplingParams(max_tokens=8, **GREEDY))
    results = run_to_completion(engine)
    assert results["c"].outputs[0].token_ids == greedy_alone(prompt_c, 6)
    assert results["a"].outputs[0].token_ids == greedy_alone(prompt_a, 8)
    assert all(result.error is None for result in results.values())
    assert_pool_consistent(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_model_forward_exception_spares_a_running_request_left_out_of_that_step():
    """A request that runs but got no token budget in the failed step goes on: "long" arrived
    earlier (it is first in the running order) and its 8-token prefill chunks fill the
    budget, so "short" sits the failed step out."""
    engine = make_tiny_engine(max_num_batched_tokens=8, max_num_seqs=2)
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=10, **GREEDY), arrival_time=100.0)
    engine.step()
    engine.add_request("long", list(range(20, 60)), SamplingParams(max_tokens=4, **GREEDY), arrival_time=0.0)
    engine.step()  # short decodes one token, long prefills 7
    failures = fail_forward_once(engine, lambda scheduled: [r.request_id for r in scheduled] == ["long"])
    results = run_to_completion(engine)
    assert failures == [["long"]]
    assert results["long"].outputs[0].finish_reason == "error"
    assert results["short"].outputs[0].finish_reason == "length"
    assert results["short"].outputs[0].token_ids == greedy_alone([1, 2, 3], 10)
    assert_pool_consistent(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_model_forward_failure_is_500_for_its_requests_and_the_server_keeps_serving():
    """Over HTTP: the non-streaming request of the failed step gets OpenAI's error JSON with
    500, the streaming one an error event then [DONE]; the request that waited meanwhile
    completes, /health stays 200, the gauges go back to idle."""
    engine = slowed(make_tiny_engine(max_num_seqs=2), 0.02)
    failures = fail_forward_once(engine, lambda scheduled: len(scheduled) == 2 and engine.scheduler.num_waiting == 1)
    with InThreadServer(engine) as server:
        url = server.url + "/v1/completions"

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                async def streaming():
                    async with client.stream("POST", url, json={"prompt": [1, 2, 3], "max_tokens": 100,
                                                                "stream": True, "temperature": 0}) as response:
                        return response.status_code, sse_events([line async for line in response.aiter_lines()])

                async def waiting():
                    await asyncio.to_thread(wait_for_metrics, server.url,
                                            lambda v: v["pagedllm:num_requests_running"] == 2)
                    return await client.post(url, json={"prompt": [4, 5], "max_tokens": 5, "temperature": 0})
                return await asyncio.gather(
                    streaming(), client.post(url, json={"prompt": [7, 8, 9], "max_tokens": 100}), waiting())

        (stream_status, events), plain, later = asyncio.run(run())
        assert len(failures) == 1 and len(failures[0]) == 2
        assert stream_status == 200 and events[-1] == "[DONE]"
        assert events[-2] == {"error": {"message": "the model forward failed: RuntimeError: injected forward fault",
                                        "type": "InternalServerError", "param": None, "code": 500}}
        assert all(choice["finish_reason"] is None for event in events[:-2] for choice in event["choices"])
        assert plain.status_code == 500
        assert plain.json() == events[-2]
        assert later.status_code == 200, later.text
        assert later.json()["choices"][0]["finish_reason"] == "length"
        assert later.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(server.url + "/health").status_code == 200
        again = httpx.post(url, json={"prompt": [7, 8, 9], "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        values = wait_for_metrics(server.url, idle)
        assert values[ERROR] == 2 and values["pagedllm:engine_healthy"] == 1
    pool = engine.kv_cache_manager.block_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks


def test_request_failed_error_reaches_the_stream_and_the_engine_stays_healthy():
    engine = make_tiny_engine()
    fail_forward_once(engine, lambda scheduled: True)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def run():
        stream = await async_engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RequestFailedError, match="injected forward fault"):
            async for _ in stream:
                pass
        ok = await async_engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=4))
        return [output async for output in ok][-1]

    try:
        final = asyncio.run(run())
        assert async_engine.is_healthy
    finally:
        async_engine.shutdown()
    assert final.request_id == "f" and len(final.outputs[0].token_ids) == 4
    assert final.outputs[0].finish_reason == "length"


# ------------------------------------------------------------------------ the engine's thread
def test_async_engine_builds_its_engine_on_the_thread_that_steps_it(caplog):
    """Given a function, AsyncLLMEngine builds the engine on its engine thread (one OpenMP team:
    see its docstring); a prebuilt engine stepped on another thread logs a warning once."""
    built_on, stepped_on = [], []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        engine = make_tiny_engine()
        step = engine.step
        engine.step = lambda: stepped_on.append(threading.get_ident()) or step()
        return engine

    params = SamplingParams(max_tokens=5, **GREEDY)

    async def generate(engine: AsyncLLMEngine) -> list[int]:
        outputs = [output async for output in await engine.add_request("a", [3, 4, 5], params)]
        return outputs[-1].outputs[0].token_ids

    engine = AsyncLLMEngine(build)
    assert built_on == [engine._thread.ident] and built_on[0] != threading.get_ident()
    engine.start()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
            assert asyncio.run(generate(engine)) == greedy_alone([3, 4, 5], 5)
    finally:
        engine.shutdown()
    assert set(stepped_on) == set(built_on) and not engine.is_healthy
    assert "another thread" not in caplog.text

    prebuilt = AsyncLLMEngine(make_tiny_engine())
    prebuilt.start()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
            assert asyncio.run(generate(prebuilt)) == greedy_alone([3, 4, 5], 5)
            asyncio.run(generate(prebuilt))
    finally:
        prebuilt.shutdown()
    assert caplog.text.count("steps on another thread than the one that built it") == 1


def test_async_engine_raises_what_building_raised_and_stops_cleanly_unstarted():
    def fails() -> LLMEngine:
        raise ValueError("max_model_len (9999) is more than the model's 128")

    with pytest.raises(ValueError, match=r"max_model_len \(9999\)"):
        AsyncLLMEngine(fails)
    engine = AsyncLLMEngine(make_tiny_engine)  # built, never started: shutdown must not hang
    assert engine._thread.is_alive()
    engine.shutdown(timeout=30)
    assert not engine._thread.is_alive()
    assert engine.engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_idle_async_engine_warms_the_kv_pool_and_still_serves(monkeypatch):
    """Idle, the engine thread faults the whole pool in (unless told not to, or the machine has
    under a tenth of its memory available); requests are served the same before and after."""
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def generate(engine: AsyncLLMEngine) -> list[int]:
        outputs = [output async for output in await engine.add_request("a", [3, 4, 5], params)]
        return outputs[-1].outputs[0].token_ids

    def short_of_memory() -> tuple[int, int]:
        return 64 << 30, 6 << 30  # bytes: total, available

    for warm, short, expect_warm in ((True, False, True), (False, False, False), (True, True, False)):
        if short:
            monkeypatch.setattr(async_engine, "machine_memory", short_of_memory)
        engine = AsyncLLMEngine(lambda: make_tiny_engine(num_gpu_blocks_override=40_000), warm_kv_cache=warm)
        runner = engine.engine.model_runner  # read here, only ever written by the engine thread
        caches = runner.kv_caches
        slices = len(caches) * 2 * -(-caches[0][0].numel() * caches[0][0].element_size() // model_runner.KV_WARM_SLICE)
        engine.start()
        try:
            assert asyncio.run(generate(engine)) == greedy_alone([3, 4, 5], 5)
            deadline = time.monotonic() + 60
            while expect_warm and runner._warmed < slices and time.monotonic() < deadline:
                time.sleep(0.01)
            assert runner._warmed == (slices if expect_warm else 0)
            assert asyncio.run(generate(engine)) == greedy_alone([3, 4, 5], 5)
        finally:
            engine.shutdown()


def test_ctrl_c_while_the_engine_thread_builds_waits_for_it_then_raises():
    """A KeyboardInterrupt in the constructor's wait must not leave the engine thread inside
    the model's C++ code while the interpreter exits (that aborted the process): the
    constructor lets the build finish, stops the thread, then raises."""
    built = []

    def slow_build() -> LLMEngine:
        time.sleep(1.0)
        built.append(make_tiny_engine())
        return built[-1]

    before = set(threading.enumerate())
    # Python's own Ctrl-C handler, whatever an earlier test (Ray, uvicorn) installed.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncLLMEngine(slow_build)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, handler)
    assert len(built) == 1
    assert not [thread for thread in set(threading.enumerate()) - before if thread.name == "pagedllm-engine"]
