"""Ray Serve replicas (``pagedllm serve --replicas``): prefix-aware routing against Serve's
default router on a shared-system-prompt workload, and autoscaling on queue length.

    .venv/bin/python bench/ray_serve.py routing --replicas 2                  # both routers, one run
    .venv/bin/python bench/ray_serve.py autoscale --replicas 1 --max-replicas 2

``routing``: one Ray instance; the same application is deployed with ``--router prefix``, then
with ``--router pow2`` (Serve's default, power of two choices), each time with fresh replicas
(empty caches). The workload: ``--system-prompts`` system prompts of about
``--system-tokens`` tokens each, ``--users`` users per system prompt, each user sending one chat
request (its system prompt, then its own short question; ``--max-tokens`` greedy tokens,
``ignore_eos``), in a shuffled order (seeded) by ``--concurrency`` closed-loop clients. Reported
per router: requests/s and output tokens/s over the whole workload, mean and p90 latency, and the
prefix-cache hit rate over all replicas (prompt tokens found cached / prompt tokens looked up,
from the replicas' counters) with each replica's share of the requests.

``autoscale``: one deployment with ``--replicas`` to ``--max-replicas`` replicas and
``--target-ongoing-requests``; a burst of ``--burst-seconds`` of closed-loop load by
``--concurrency`` clients, then idleness; the replica count is logged once a second until it is
back to ``--replicas`` (or ``--idle-seconds`` pass).

Any other option is ``pagedllm serve``'s (``--max-num-seqs``, ``--dtype``...). ``--engine-factory
MODULE:FUNCTION`` (this script's, not ``pagedllm serve``'s) builds the replicas' engines, e.g.
``tests.test_ray_serve:slow_tiny_chat_engine`` for the tests' tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.entrypoints.cli import build_parser  # noqa: E402
from pagedllm.entrypoints.openai.cli_args import parse_serve_args  # noqa: E402

TOPICS = ["the weather", "cooking", "chess", "astronomy", "gardening", "music theory", "sailing", "geology"]


def system_prompt(index: int, num_tokens: int) -> str:
    """A system prompt of about ``num_tokens`` tokens (about 1.3 tokens per word), distinct
    from its first words on."""
    topic = TOPICS[index % len(TOPICS)]
    words = f"You are assistant number {index}, an expert on {topic}. Answer precisely, cite sources, " \
            f"and keep a friendly tone when discussing {topic}.".split()
    return " ".join((words * (num_tokens // len(words) + 1))[:max(1, int(num_tokens / 1.3))])


async def run_workload(url: str, requests: list[dict], concurrency: int, api_key: str) -> dict:
    """Send ``requests`` (chat bodies) with ``concurrency`` closed-loop clients."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in requests:
        queue.put_nowait(body)
    latencies, output_tokens, failures = [], 0, 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal output_tokens, failures
        while not queue.empty():
            body = queue.get_nowait()
            sent = time.perf_counter()
            response = await http.post(url + "/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {api_key}"})
            if response.status_code != 200:
                failures += 1
                continue
            latencies.append(time.perf_counter() - sent)
            output_tokens += response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"elapsed_s": elapsed, "requests_per_s": len(latencies) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed, "failures": failures,
            "latency_mean_s": statistics.fmean(latencies) if latencies else float("nan"),
            "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))] if latencies else float("nan")}


def replica_reports(url: str) -> dict:
    return httpx.get(url + "/load", timeout=30).json().get("replicas", {})


def wait_for_replicas(url: str, count: int, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reports = replica_reports(url)
        except httpx.HTTPError:
            reports = {}
        if len([r for r in reports.values() if r["healthy"]]) == count:
            return reports
        time.sleep(0.5)
    raise TimeoutError(f"{count} replicas did not report within {timeout} s")


def deploy(argv: list[str], port: int, engine_factory: Optional[str] = None):
    """``pagedllm serve ARGV`` deployed on the running Ray instance, its engines built by
    ``engine_factory`` (``module:function``; default ``LLMEngine``); returns its URL."""
    from ray import serve

    from pagedllm.serve_ray.app import APP_NAME, build_application

    factory = None
    if engine_factory:
        module_name, _, function_name = engine_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), function_name)
    server_args, engine_args = parse_serve_args(build_parser().parse_args(["serve", *argv]))
    serve.run(build_application(server_args, engine_args, engine_factory=factory), name=APP_NAME, route_prefix="/",
              blocking=False)
    return f"http://127.0.0.1:{port}"


def routing(options: argparse.Namespace, serve_argv: list[str]) -> None:
    from ray import serve

    rng = random.Random(options.seed)
    requests = [{"model": options.model_name, "max_tokens": options.max_tokens, "temperature": 0,
                 "ignore_eos": True,
                 "messages": [{"role": "system", "content": system_prompt(s, options.system_tokens)},
                              {"role": "user", "content": f"User {u}: what should I know first?"}]}
                for s in range(options.system_prompts) for u in range(options.users)]
    rng.shuffle(requests)
    print(f"workload: {options.system_prompts} system prompts x {options.users} users = {len(requests)} "
          f"chat requests, ~{options.system_tokens} system tokens each, {options.max_tokens} output tokens, "
          f"{options.concurrency} clients; {options.replicas} replicas", flush=True)
    for router in ("prefix", "pow2"):
        url = deploy([*serve_argv, "--replicas", str(options.replicas), "--router", router], options.port,
                     options.engine_factory)
        before = wait_for_replicas(url, options.replicas)
        result = asyncio.run(run_workload(url, requests, options.concurrency, options.api_key))
        time.sleep(2 * options.report_wait)
        after = replica_reports(url)
        queries = {r: after[r]["prefix_cache_queries"] - before.get(r, {}).get("prefix_cache_queries", 0)
                   for r in after}
        hits = sum(after[r]["prefix_cache_hits"] - before.get(r, {}).get("prefix_cache_hits", 0) for r in after)
        share = " ".join(f"{100 * q / max(1, sum(queries.values())):.0f}%" for q in sorted(queries.values()))
        print(f"router {router:6}: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} "
              f"output tok/s, latency mean {result['latency_mean_s']:.2f} s p90 {result['latency_p90_s']:.2f} s, "
              f"prefix-cache hit rate {100 * hits / max(1, sum(queries.values())):.1f}% "
              f"(prompt tokens per replica: {share}), failures {result['failures']}", flush=True)
        serve.delete("pagedllm")


def autoscale(options: argparse.Namespace, serve_argv: list[str]) -> None:
    url = deploy([*serve_argv, "--replicas", str(options.replicas), "--max-replicas", str(options.max_replicas),
                  "--target-ongoing-requests", str(options.target_ongoing_requests)], options.port,
                 options.engine_factory)
    wait_for_replicas(url, options.replicas)
    body = {"model": options.model_name, "max_tokens": options.max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about sailing."}]}
    started = time.monotonic()

    async def burst() -> None:
        async def client(http: httpx.AsyncClient) -> None:
            while time.monotonic() - started < options.burst_seconds:
                await http.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {options.api_key}"})
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(client(http) for _ in range(options.concurrency)))

    async def log_replicas() -> None:
        peak = 0
        while True:
            reports = await asyncio.to_thread(replica_reports, url)
            elapsed = time.monotonic() - started
            phase = "load" if elapsed < options.burst_seconds else "idle"
            waiting = sum(r["waiting"] for r in reports.values())
            running = sum(r["running"] for r in reports.values())
            print(f"t={elapsed:5.1f}s {phase}: {len(reports)} replica(s), running {running}, waiting {waiting}",
                  flush=True)
            peak = max(peak, len(reports))
            if elapsed > options.burst_seconds and (len(reports) == options.replicas and peak > options.replicas
                                                    or elapsed > options.burst_seconds + options.idle_seconds):
                print(f"peak {peak} replica(s); back to {len(reports)} after {elapsed - options.burst_seconds:.0f} s "
                      "idle", flush=True)
                return
            await asyncio.sleep(1.0)

    async def main() -> None:
        logger = asyncio.create_task(log_replicas())
        await burst()
        await logger
    asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["routing", "autoscale"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--target-ongoing-requests", type=float, default=2)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--burst-seconds", type=float, default=30)
    parser.add_argument("--idle-seconds", type=float, default=90)
    parser.add_argument("--report-wait", type=float, default=0.5, help="the replicas' report period, seconds")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default="bench")
    parser.add_argument("--model-name", default="bench")
    parser.add_argument("--engine-factory", default=None, metavar="MODULE:FUNCTION",
                        help="builds each replica's engine from its EngineArgs (default: LLMEngine)")
    options, serve_argv = parser.parse_known_args()
    serve_argv = [*serve_argv, "--api-key", options.api_key, "--served-model-name", options.model_name]

    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": options.port})
    try:
        (routing if options.mode == "routing" else autoscale)(options, serve_argv)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
