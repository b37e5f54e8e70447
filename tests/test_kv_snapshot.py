"""The block-pool snapshot behind ``/debug/kv`` and ``/dashboard`` (``engine/kv_snapshot.py``):
exact block states, owners, block tables, prefix-cache hit counts, fork and copy-on-write
events after known steps of the tiny model (block tables derived by hand from the pool's
free-queue order), its invariants at every step of a run that preempts, when the async engine
takes one, and the routes (API key, ``--disable-dashboard``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from starlette.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheManager, SharingEvent
from pagedllm.core.request import Request
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.kv_snapshot import BLOCK_STATES, CACHED_FREE, FREE, IN_USE, SHARED, KVCacheSnapshot
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerArgs
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_engine, run_to_completion
from tests.test_server import MODEL, InThreadServer, failing_at_step, smollm2_tokenizer, tiny_chat_engine

PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def states(snapshot: KVCacheSnapshot, count: int) -> list[str]:
    return [BLOCK_STATES[state] for state in snapshot.block_state[:count]]


def tables(snapshot: KVCacheSnapshot) -> dict[str, tuple]:
    return {r.request_id: (r.status, r.block_table, r.num_cached_blocks) for r in snapshot.requests}


def check_consistent(snapshot: KVCacheSnapshot) -> None:
    """What must hold in every snapshot, whatever the engine did."""
    counters, num_blocks = snapshot.counters, len(snapshot.block_state)
    by_state = [snapshot.block_state.count(code) for code in range(4)]
    assert sum(by_state) == num_blocks == counters.num_blocks  # free + used == total
    assert (by_state[FREE] + by_state[CACHED_FREE], by_state[CACHED_FREE]) == (counters.num_free_blocks,
                                                                               counters.num_cached_free_blocks)
    assert (by_state[IN_USE] + by_state[SHARED], by_state[SHARED]) == (counters.num_used_blocks,
                                                                       counters.num_shared_blocks)
    holders: dict[int, list[int]] = {}
    for index, request in enumerate(snapshot.requests):
        assert (request.status == "running") == bool(request.block_table), request
        for block_id in request.block_table:
            holders.setdefault(block_id, []).append(index)
    for block_id in range(num_blocks):
        owners = holders.get(block_id, [])
        assert snapshot.ref_count[block_id] == len(owners), block_id
        assert snapshot.owner[block_id] == (owners[0] if owners else -1), block_id
        assert (snapshot.block_state[block_id] == SHARED) == (len(owners) > 1)
    assert counters.num_reserved_slots == counters.num_used_blocks * snapshot.block_size
    assert 0 <= counters.num_stored_tokens <= counters.num_reserved_slots


def test_prefix_cache_hits_shared_blocks_and_cached_free_blocks_exactly():
    # Blocks of 4 tokens, handed out from the front of the free queue: 0, 1, 2, ...
    engine = make_tiny_engine()
    engine.add_request("a", list(range(1, 11)), PARAMS)  # 10 tokens: blocks 0, 1 full, 2 partial
    first = engine.make_kv_snapshot()
    assert (first.version, first.step) == (1, 0)
    assert tables(first) == {"a": ("waiting", (), 0)} and set(first.block_state) == {FREE}
    engine.step()
    engine.add_request("b", list(range(1, 9)) + [50, 51, 52], PARAMS)  # shares a's 2 full blocks
    engine.step()
    snapshot = engine.make_kv_snapshot()
    check_consistent(snapshot)
    assert (snapshot.version, snapshot.step, snapshot.block_size) == (2, 2, 4)
    # b hit a's cached blocks 0 and 1 (8 of its 11 prompt tokens) and computed the rest in 3.
    assert tables(snapshot) == {"a": ("running", (0, 1, 2), 0), "b": ("running", (0, 1, 3), 2)}
    assert states(snapshot, 5) == ["shared", "shared", "in_use", "in_use", "free"]
    assert snapshot.ref_count[:5] == (2, 2, 1, 1, 0) and snapshot.owner[:5] == (0, 0, 0, 1, -1)
    a, b = snapshot.requests
    assert (a.num_prompt_tokens, a.num_computed_tokens, a.num_tokens) == (10, 11, 12)
    assert (b.num_prompt_tokens, b.num_computed_tokens, b.num_tokens) == (11, 11, 12)
    counters = snapshot.counters
    assert dataclasses.asdict(counters) == dict(
        num_blocks=64, num_free_blocks=60, num_cached_free_blocks=0, num_used_blocks=4, num_shared_blocks=2,
        num_running=2, num_waiting=0, num_preempted=0, num_preemptions=0,
        prefix_cache_queries=21, prefix_cache_hits=8,  # a: 10 looked up, 0 found; b: 11, 8
        num_evictions=0, num_forks=0, num_copies=0,
        num_stored_tokens=4 + 4 + 3 + 3,  # blocks 0, 1 full; a's and b's third blocks hold 3 each
        num_reserved_slots=16,
        num_contiguous_slots=(10 + 20) + (11 + 20),  # prompt + max_tokens each
        spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0)  # no speculative decoding
    assert counters.prefix_cache_hit_rate == 8 / 21 and counters.kv_cache_usage == 4 / 64

    engine.abort_request("a")  # its partial block 2 goes back empty; 0 and 1 stay with b
    snapshot = engine.make_kv_snapshot()
    check_consistent(snapshot)
    assert tables(snapshot) == {"b": ("running", (0, 1, 3), 2)}
    assert states(snapshot, 5) == ["in_use", "in_use", "free", "in_use", "free"]
    engine.abort_request("b")  # 0 and 1 are full and cached: hit-able while free
    snapshot = engine.make_kv_snapshot()
    check_consistent(snapshot)
    assert snapshot.requests == () and states(snapshot, 5) == ["cached_free", "cached_free", "free", "free", "free"]
    assert (snapshot.counters.num_free_blocks, snapshot.counters.num_cached_free_blocks) == (64, 2)


def test_fork_and_copy_on_write_events_after_n_2():
    engine = make_tiny_engine()
    engine.add_request("x", list(range(1, 7)), SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=0))
    waiting = engine.make_kv_snapshot()
    assert [(r.request_id, r.status, r.num_pending_forks) for r in waiting.requests] == [("x[0]", "waiting", 1)]
    engine.step()  # x[0] prefills 6 tokens into blocks 0, 1; x[1] forks off them
    snapshot = engine.make_kv_snapshot()
    check_consistent(snapshot)
    assert tables(snapshot) == {"x[0]": ("running", (0, 1), 0), "x[1]": ("running", (0, 1), 0)}
    assert states(snapshot, 3) == ["shared", "shared", "free"] and snapshot.ref_count[:2] == (2, 2)
    assert snapshot.events == (SharingEvent(0, "fork", ("x", 1), parent_id=("x", 0), num_blocks=2),)
    engine.step()  # both write token 7 into block 1: x[0] first, so x[0] gets the copy (block 2)
    snapshot = engine.make_kv_snapshot()
    check_consistent(snapshot)
    assert tables(snapshot) == {"x[0]": ("running", (0, 2), 0), "x[1]": ("running", (0, 1), 0)}
    assert states(snapshot, 4) == ["shared", "in_use", "in_use", "free"]
    assert snapshot.events[1] == SharingEvent(1, "copy", ("x", 0), logical_index=1, src_block_id=1, dst_block_id=2)
    assert (snapshot.counters.num_forks, snapshot.counters.num_copies) == (1, 1)
    assert json.loads(snapshot.json)["events"] == [
        {"serial": 0, "kind": "fork", "request_id": "x[1]", "parent_id": "x[0]", "num_blocks": 2},
        {"serial": 1, "kind": "copy", "request_id": "x[0]", "num_blocks": 1, "logical_index": 1,
         "src_block_id": 1, "dst_block_id": 2}]
    run_to_completion(engine)
    final = engine.make_kv_snapshot()
    check_consistent(final)
    assert final.requests == () and final.counters.num_used_blocks == 0 and len(final.events) == 2


def test_every_snapshot_is_consistent_in_a_pool_that_preempts():
    # The pool of test_engine_stats: 6 blocks of 4; b is preempted at step 7 and resumes at 11.
    engine = make_tiny_engine(num_gpu_blocks_override=6, max_model_len=24, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    now = time.monotonic()
    engine.add_request("a", list(range(1, 8)), params, arrival_time=now - 2.0)
    engine.add_request("b", list(range(11, 16)), params, arrival_time=now - 1.0)
    seen = []
    for _ in range(11):
        engine.step()
        snapshot = engine.make_kv_snapshot()
        check_consistent(snapshot)
        seen.append([(r.request_id, r.status, len(r.block_table), r.num_preemptions) for r in snapshot.requests])
    assert seen[6] == [("a", "running", 4, 0), ("b", "preempted", 0, 1)]  # a needed b's blocks
    assert seen[9] == [("b", "preempted", 0, 1)]  # a finished
    assert seen[10] == [("b", "running", 3, 1)]  # b recomputed its 11 tokens
    counters = engine.make_kv_snapshot().counters
    assert (counters.num_preemptions, counters.num_waiting, counters.num_running) == (1, 0, 1)


def test_recent_events_are_a_bounded_window():
    manager = KVCacheManager(num_blocks=8, block_size=4, max_recent_events=3)
    parent = Request("p", [1, 2, 3, 4, 5], PARAMS, max_tokens=4, eos_token_id=None)
    assert manager.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    for index in range(5):
        child = Request(f"c{index}", [1, 2, 3, 4, 5], PARAMS, max_tokens=4, eos_token_id=None)
        manager.fork(parent, child)
    assert [(event.serial, event.request_id) for event in manager.recent_events] == [(2, "c2"), (3, "c3"), (4, "c4")]
    assert manager.num_forks == 5 and manager.block_pool.block_states()[0][:3] == [6, 6, 0]


def test_async_engine_takes_snapshots_only_when_asked_and_reuses_an_unchanged_one():
    engine = make_tiny_engine()
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def run():
        stream = await async_engine.add_request("r", list(range(1, 11)), PARAMS)
        async for _ in stream:
            pass
        # 21 steps ran with nobody looking: no snapshot was taken.
        assert async_engine.kv_snapshot is None and engine._kv_snapshot_version == 0
        first = await async_engine.get_kv_snapshot()
        again = await async_engine.get_kv_snapshot()
        return first, again

    try:
        first, again = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert first is again and first.version == 1 and async_engine.kv_snapshot is first
    assert first.requests == () and first.counters.num_cached_free_blocks == 7  # 29 of 30 tokens, full blocks
    assert first.counters.prefix_cache_queries == 10


@pytest.fixture(scope="module")
def chat_engine_args():
    smollm2_tokenizer()
    return EngineArgs.from_kwargs(block_size=4, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=16,
                                  max_num_batched_tokens=64)


def test_debug_routes_need_the_api_key_and_the_page_is_static(chat_engine_args):
    with InThreadServer(tiny_chat_engine(chat_engine_args), api_key="sk-x") as server:
        url, auth = server.url, {"Authorization": "Bearer sk-x"}
        for path in ("/debug/kv", "/debug/kv/stream"):
            refused = httpx.get(url + path)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "window.__pagedllm" in page.text and "http://" not in page.text and "https://" not in page.text
        body = httpx.get(url + "/debug/kv", headers=auth).json()
        assert body["num_blocks"] == 64 and body["block_states"] == list(BLOCK_STATES)
        assert body["blocks"] == {"state": [FREE] * 64, "ref_count": [0] * 64, "owner": [-1] * 64}
        with httpx.stream("GET", url + "/debug/kv/stream", headers=auth, timeout=10) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            assert next(lines) == f"id: {body['version']}"  # nothing changed: the same snapshot
            assert json.loads(next(lines).removeprefix("data: ")) == body
        deadline = time.monotonic() + 5
        while server.engine._kv_subscribers:  # the engine stops taking them for a gone client
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_disable_dashboard_removes_the_routes(chat_engine_args):
    assert build_parser().parse_args(["serve", "--disable-dashboard"]).disable_dashboard is True
    assert build_parser().parse_args(["serve"]).disable_dashboard is False
    async_engine = AsyncLLMEngine(tiny_chat_engine(chat_engine_args))
    async_engine.start()
    try:
        with TestClient(build_app(async_engine, ServerArgs(served_model_name=[MODEL], disable_dashboard=True))) \
                as client:
            for path in ("/debug/kv", "/debug/kv/stream", "/dashboard"):
                response = client.get(path)
                assert response.status_code == 404 and "no such endpoint" in response.json()["error"]["message"]
            assert client.get("/health").status_code == 200
    finally:
        async_engine.shutdown()
    assert async_engine.kv_snapshot is None


def test_a_dead_engine_ends_the_stream_and_debug_kv_is_503():
    engine = failing_at_step(make_tiny_engine(), 3)
    with InThreadServer(engine) as server:
        with httpx.stream("GET", server.url + "/debug/kv/stream", timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines) == "id: 1"
            httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 50}, timeout=30)
            for _ in lines:  # ends when the loop dies (after at most a few newer versions)
                pass
        assert not server.engine.is_healthy
        dead = httpx.get(server.url + "/debug/kv")
        assert dead.status_code == 503 and "injected fault" in dead.json()["error"]["message"]
        assert httpx.get(server.url + "/debug/kv/stream").status_code == 503
