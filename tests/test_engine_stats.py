"""The engine's published snapshots (``engine/stats.py``): exact ``SchedulerStats`` after known
steps in a pool that preempts, and a server whose event loop reads nothing of the
``LLMEngine`` (every route works while the engine refuses any thread but its own)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.stats import IterationStats, LoadStats, LoadTracker, SchedulerStats
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_engine
from tests.test_server import MODEL, InThreadServer, idle, smollm2_tokenizer, tiny_chat_engine, wait_for_metrics


def state(stats: SchedulerStats) -> tuple:
    return (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_used_blocks, stats.num_preemptions)


def test_stats_after_each_step_in_a_pool_that_preempts():
    # 6 blocks of 4 tokens: "a" (7 + 10 tokens) and "b" (5 + 10) cannot both run to the end.
    engine = make_tiny_engine(num_gpu_blocks_override=6, max_model_len=24, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    now = time.monotonic()
    engine.add_request("a", list(range(1, 8)), params, arrival_time=now - 2.0)
    engine.add_request("b", list(range(11, 16)), params, arrival_time=now - 1.0)
    stats = engine.make_stats()
    assert state(stats) == (0, 2, 0, 0) and stats.num_blocks == 6
    assert stats.iteration == IterationStats() and stats.kv_cache_usage == 0.0

    snapshots = []
    for _ in range(11):
        engine.step()
        snapshots.append(engine.make_stats())
    # (running, waiting, blocks used, preemptions total) after steps 1..11
    assert [state(s) for s in snapshots] == [
        (2, 0, 4, 0),  # both prefilled: 2 blocks each
        (2, 0, 4, 0),
        (2, 0, 5, 0),  # a's 9th token opens its 3rd block
        (2, 0, 5, 0),
        (2, 0, 6, 0),  # b's 9th token: the pool is full
        (2, 0, 6, 0),
        (1, 1, 4, 1),  # a needs a 4th block: b (the younger) is preempted, its 3 blocks freed
        (1, 1, 4, 1),  # b (11 tokens, 3 blocks) does not fit the 2 free blocks
        (1, 1, 4, 1),
        (0, 1, 0, 1),  # a's 10th token: a finished, its blocks freed
        (1, 0, 3, 1),  # b recomputes its 5 prompt and 6 output tokens
    ]
    assert [s.iteration.step for s in snapshots] == list(range(1, 12))
    first = snapshots[0].iteration
    assert (first.num_scheduled_tokens, first.num_prompt_tokens, first.num_output_tokens) == (12, 12, 0)
    assert len(first.queue_times) == 2 and first.queue_times[0] >= 2.0 and first.queue_times[1] >= 1.0
    assert snapshots[1].iteration == IterationStats(step=2, num_scheduled_tokens=2, num_output_tokens=2)
    assert snapshots[6].iteration == IterationStats(step=7, num_scheduled_tokens=1, num_output_tokens=1,
                                                    num_preempted=1)
    # Resumed after preemption: its generated tokens count as output, its queue time not twice.
    assert snapshots[10].iteration == IterationStats(step=11, num_scheduled_tokens=11, num_prompt_tokens=5,
                                                     num_output_tokens=6)
    assert snapshots[4].kv_cache_usage == 1.0
    # A snapshot is a value: later steps do not change it.
    assert state(snapshots[0]) == (2, 0, 4, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshots[0].num_running_reqs = 0


class EngineThreadOnly:
    """Stands in for the ``LLMEngine`` once the engine thread runs: forwards every attribute
    read on that thread and refuses (and records) a read from any other thread."""

    def __init__(self, engine, owner: threading.Thread) -> None:
        self._engine = engine
        self._owner = owner
        self.violations: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        if threading.current_thread() is not self._owner:
            self.violations.append((threading.current_thread().name, name))
            raise AssertionError(f"LLMEngine.{name} read from thread {threading.current_thread().name}")
        return getattr(self._engine, name)


def test_server_routes_read_nothing_of_the_engine_outside_its_thread(monkeypatch):
    smollm2_tokenizer()
    guards = []
    start = AsyncLLMEngine.start

    def guarded_start(self: AsyncLLMEngine) -> None:
        self.engine = EngineThreadOnly(self.engine, self._thread)
        guards.append(self.engine)
        start(self)

    monkeypatch.setattr(AsyncLLMEngine, "start", guarded_start)
    args = EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=16,
                                  max_num_batched_tokens=64)
    with InThreadServer(tiny_chat_engine(args)) as server:
        url = server.url
        (guard,) = guards
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/livez").status_code == httpx.get(url + "/readyz").status_code == 200
        assert httpx.get(url + "/load").json()["num_blocks"] == 64
        assert httpx.get(url + "/version").status_code == 200
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 128
        tokens = httpx.post(url + "/tokenize", json={"prompt": "hello there"}).json()
        assert tokens["max_model_len"] == 128 and tokens["count"] == len(tokens["tokens"]) > 0
        chat_tokens = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat_tokens.status_code == 200
        assert httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello there"
        assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400  # vocab_size
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True}
        completion = httpx.post(url + "/v1/completions", json={**body, "prompt": "hi"}, timeout=30)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
        chat = httpx.post(url + "/v1/chat/completions", timeout=30,
                          json={**body, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            with httpx.stream("POST", url + path, json={**body, **extra, "stream": True}, timeout=30) as stream:
                assert stream.status_code == 200
                assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        too_long = httpx.post(url + "/v1/completions", json={**body, "prompt": [1] * 200}, timeout=30)
        assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]["message"]
        wait_for_metrics(url, idle)
        assert httpx.get(url + "/metrics").status_code == 200
        # The live block-pool view: snapshots taken by the engine thread, never the engine read here.
        assert httpx.get(url + "/dashboard").status_code == 200
        kv = httpx.get(url + "/debug/kv", timeout=30).json()
        assert kv["counters"]["num_used_blocks"] == 0 and kv["counters"]["prefix_cache_queries"] > 0
        with httpx.stream("GET", url + "/debug/kv/stream", timeout=30) as stream:
            data = next(line for line in stream.iter_lines() if line.startswith("data: "))
            assert json.loads(data.removeprefix("data: "))["version"] == kv["version"]
        # Readers on this thread see the published snapshots, not the engine.
        stats = server.engine.stats
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_used_blocks) == (0, 0, 0)
        assert stats.iteration.step > 0 and server.engine.model_info.vocab_size > 0
        assert guard.violations == []


def test_finish_rate_counts_finishes_over_the_steps_that_made_them():
    """Found by a fresh user: finishes all made by one step (a batch of prompts ending
    together) had one timestamp, so the rate was 0 ("unknown") and queue-wait shedding was off
    until more finished. Each finish now dates from its step's start: n finishes from the
    first one's step start to now."""
    tracker = LoadTracker()
    tracker.record_step(0.5, 4, now=10.0)  # 4 finishes by a step of 10.0 - 0.5 .. 10.0
    assert tracker.snapshot(10.0).finish_rate == 4 / 0.5
    assert tracker.snapshot(12.5).finish_rate == 4 / 3.0  # decays while nothing finishes
    tracker.record_step(0.5, 1, now=13.0)
    assert tracker.snapshot(13.0) == LoadStats(step_time=0.5, finish_rate=5 / 3.5, num_steps=2, num_finished=5)
    one = LoadTracker()
    one.record_step(0.5, 1, now=10.0)
    assert one.snapshot(10.0).finish_rate == 0.0  # one finish: unknown
