"""``/dashboard`` in a real browser: Debian's ``chromium`` (``.ci/run`` installs it), driven by
Playwright through ``executable_path`` (Playwright never downloads a browser here).

A live ``pagedllm serve`` (the tiny random llama with SmolLM2's vocabulary, each step slowed
to ``STEP_SECONDS`` so that requests stay in flight) runs streaming requests: three share a
60-token prefix (the later two hit its cached blocks), one has ``n=2`` (a fork, then a
copy-on-write), one more runs and one waits for a seat. The page's own state
(``window.__pagedllm``, counted while it draws the grid) must equal ``/debug/kv`` at the same
snapshot version; clicking a request must highlight exactly its block table; a synthetic
20,000-block pool must draw quickly. The screenshot is ``docs/dashboard.png`` (in docs/dashboard.md).

Skipped only where chromium or Playwright is missing and ``CI`` is not ``true``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm import envs
from pagedllm.engine.kv_snapshot import CACHED_FREE, FREE, IN_USE, SHARED, KVCacheSnapshot, KVCounters, RequestBlocks
from tests.test_server import REPO_ROOT, ServerProcess, slowed, tiny_chat_engine

CHROMIUM = Path("/usr/bin/chromium")
IN_CI = os.environ.get("CI") == "true"
if not IN_CI and not CHROMIUM.exists():
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; CI installs it)",
                allow_module_level=True)
if IN_CI:
    from playwright.sync_api import sync_playwright
else:
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright

BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API_KEY = "sk-dashboard"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STEP_SECONDS = 0.3
BLOCK_SIZE = 8
NUM_BLOCKS = 384
PREFIX = list(range(1000, 1060))  # 60 tokens: 7 full blocks of 8
# The docs' picture is refreshed only on request (PAGEDLLM_UPDATE_SCREENSHOT=1): request ids
# are random, so writing it on every run would leave the tree modified.
SCREENSHOT = REPO_ROOT / "docs" / "dashboard.png"


def slow_tiny_chat_engine(engine_args):
    """The server's engine factory: the tiny chat engine, each step ``STEP_SECONDS`` long."""
    return slowed(tiny_chat_engine(engine_args), STEP_SECONDS)


class StreamingRequest(threading.Thread):
    """A streaming completion read chunk by chunk until ``stop()``, which hangs up (the
    server then aborts it and frees its blocks)."""

    def __init__(self, url: str, prompt: list[int], **body) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": "tiny", "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
                                    "stream": True, **body}
        self.first_chunk = threading.Event()
        self._hang_up = threading.Event()
        self.error = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=AUTH, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.first_chunk.set()
                    if self._hang_up.is_set():
                        return
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self) -> None:
        self._hang_up.set()
        self.join(10)


def debug_kv(url: str) -> dict:
    reply = httpx.get(url + "/debug/kv", headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_for_kv(url: str, condition, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = debug_kv(url)
        if condition(kv):
            return kv
        assert time.monotonic() < deadline, f"the pool never got there: {kv['counters']}"
        time.sleep(0.1)


def page_state(page) -> dict:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.__pagedllm))")


def same_version(page, url: str) -> tuple[dict, dict]:
    """``/debug/kv`` and the page's state at one snapshot version (the pool changes every
    step, so retry until the page shows the version the server just served)."""
    for _ in range(40):
        kv = debug_kv(url)
        try:
            page.wait_for_function(f"window.__pagedllm.version >= {kv['version']}", timeout=3000)
        except Exception:  # noqa: BLE001 - a Playwright timeout: try a newer version
            continue
        state = page_state(page)
        if state["version"] == kv["version"]:
            return kv, state
    raise AssertionError("the page never showed the version /debug/kv served")


def counts_by_state(kv: dict) -> dict[str, int]:
    return {name: kv["blocks"]["state"].count(code) for code, name in enumerate(kv["block_states"])}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        "--served-model-name", "tiny",
        "--api-key", API_KEY, "--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "6", "--max-num-batched-tokens", "512",
        log_path=tmp_path_factory.mktemp("dashboard") / "server.log",
        engine_factory="tests.test_dashboard:slow_tiny_chat_engine")
    try:
        process.wait_ready()
    except BaseException:
        process.stop()
        raise
    yield process
    assert process.stop() == 0, process.log_path.read_text()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=BROWSER_ARGS, viewport={"width": 1280, "height": 900})
        yield context
        context.close()


def test_dashboard_matches_debug_kv_and_highlights_a_block_table(server, browser, tmp_path):
    url = server.url
    done = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": list(range(4000, 4041)), "max_tokens": 1})
    assert done.status_code == 200, done.text  # its 5 full blocks stay cached-free (hit-able)
    first = StreamingRequest(url, PREFIX + [7, 7, 7, 7, 7])
    first.start()
    assert first.first_chunk.wait(60), first.error  # its prefix blocks are cached now
    others = [StreamingRequest(url, list(range(2000, 2013)), n=2)]  # a fork, then a copy-on-write
    others += [StreamingRequest(url, PREFIX + [8 + i] * 5) for i in range(2)]
    others += [StreamingRequest(url, list(range(3000 + 20 * i, 3017 + 20 * i))) for i in range(2)]
    requests = [first, *others]
    try:
        for request in others:  # one at a time, so that the last one is the one left waiting
            request.start()
            if request is not others[-1]:
                assert request.first_chunk.wait(60), request.error
        kv = wait_for_kv(url, lambda kv: kv["counters"]["num_running"] == 6 and kv["counters"]["num_waiting"] == 1
                         and kv["counters"]["num_copies"] >= 1)
        assert kv["counters"]["num_forks"] == 1 and kv["counters"]["prefix_cache_hits"] == 2 * 56

        page = browser.new_page()
        page.goto(url + f"/dashboard#key={API_KEY}")
        page.wait_for_function("window.__pagedllm.version > 0", timeout=30_000)
        assert "key=" not in page.url  # dropped from the address bar once read

        kv, state = same_version(page, url)
        counts = counts_by_state(kv)
        assert state["counts"] == counts and state["numBlocks"] == NUM_BLOCKS
        counters = kv["counters"]
        assert (counts["free"] + counts["cached_free"], counts["cached_free"]) == (counters["num_free_blocks"],
                                                                                 counters["num_cached_free_blocks"])
        assert counts["in_use"] + counts["shared"] == counters["num_used_blocks"]
        assert sum(counts.values()) == NUM_BLOCKS and counts["shared"] >= 7 and counts["in_use"] > 0
        assert counts["cached_free"] == 5

        hit = next(r for r in kv["requests"] if r["num_cached_blocks"] == 7)
        page.click(f'tr.req[data-request-id="{hit["request_id"]}"]')
        page.wait_for_function(f"window.__pagedllm.selected === {json.dumps(hit['request_id'])}", timeout=5000)
        kv, state = same_version(page, url)
        table = next(r for r in kv["requests"] if r["request_id"] == hit["request_id"])["block_table"]
        assert state["active"] == hit["request_id"] and state["highlighted"] == sorted(set(table))
        assert len(table) >= 8 and table[:7] == hit["block_table"][:7]  # the shared prefix blocks stay

        events = page.inner_text("#events")
        assert "fork" in events and "copy" in events
        assert "waiting (1)" in page.inner_text("#reqbody") and "running (6)" in page.inner_text("#reqbody")
        update = envs.PAGEDLLM_UPDATE_SCREENSHOT
        screenshot = SCREENSHOT if update else tmp_path / "dashboard.png"
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000
        page.close()
    finally:
        for request in requests:
            request.stop()
    assert all(request.error is None for request in requests), [request.error for request in requests]
    idle = wait_for_kv(url, lambda kv: kv["counters"]["num_running"] + kv["counters"]["num_waiting"] == 0)
    assert idle["counters"]["num_used_blocks"] == 0  # every hung-up request's blocks came back


def synthetic_snapshot(num_blocks: int, num_requests: int, blocks_each: int) -> KVCacheSnapshot:
    """A large pool in the server's own JSON form: request ``i`` holds blocks
    ``[i * blocks_each, (i + 1) * blocks_each)`` plus block 0 (shared by all), and the
    next ``num_blocks // 10`` blocks are cached-free."""
    state, ref_count, owner = [FREE] * num_blocks, [0] * num_blocks, [-1] * num_blocks
    requests = []
    for index in range(num_requests):
        table = [0] + list(range(index * blocks_each + 1, (index + 1) * blocks_each + 1))
        for block_id in table:
            ref_count[block_id] += 1
            owner[block_id] = owner[block_id] if owner[block_id] >= 0 else index
            state[block_id] = SHARED if ref_count[block_id] > 1 else IN_USE
        requests.append(RequestBlocks(f"req-{index}", "running", 100, 8 * len(table), 8 * len(table), tuple(table),
                                      1, 0, 0))
    used = num_requests * blocks_each + 1
    for block_id in range(used, used + num_blocks // 10):
        state[block_id] = CACHED_FREE
    counters = KVCounters(num_blocks, num_blocks - used, num_blocks // 10, used, 1, num_requests, 0, 0, 0, 0, 0, 0,
                          0, 0, used * 8, used * 8, 0)
    return KVCacheSnapshot(1, 1, 8, tuple(state), tuple(ref_count), tuple(owner), tuple(requests), counters, ())


def test_twenty_thousand_blocks_draw_without_freezing_the_page(server, browser):
    snapshot = synthetic_snapshot(20_000, num_requests=250, blocks_each=64)
    page = browser.new_page()
    page.route("**/debug/kv/stream", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=f"id: 1\ndata: {snapshot.json}\n\n"))
    page.goto(server.url + f"/dashboard#key={API_KEY}")
    page.wait_for_function("window.__pagedllm.version === 1", timeout=30_000)
    state = page_state(page)
    assert state["counts"] == {"free": 20_000 - 16_001 - 2_000, "cached_free": 2_000, "in_use": 16_000, "shared": 1}
    assert state["cellSize"] >= 3
    page.click('tr.req[data-request-id="req-249"]')
    page.wait_for_function("window.__pagedllm.active === 'req-249'", timeout=5000)
    assert page_state(page)["highlighted"] == [0] + list(range(249 * 64 + 1, 250 * 64 + 1))
    # A redraw of 20,000 cells; generous for a loaded 2-core machine (it takes a few ms idle).
    assert page_state(page)["drawMs"] < 500
    page.close()
