"""Online serving benchmark: the throughput workload sent to a running ``pagedllm serve``.

    pagedllm serve --port 8000 &
    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 --request-rate 2
    .venv/bin/python bench/serve.py --max-concurrency 8          # closed loop, 8 clients

Requests are the 64 of ``pagedllm bench throughput`` (prompts of 32-512 tokens cut from
shipped public-domain text, 32-256 output tokens, greedy, ``ignore_eos``), sent as token ids to
``/v1/completions`` with ``stream: true``. Arrivals are a Poisson process at ``--request-rate``
requests/s (exponential gaps, seeded; ``inf`` sends everything at once), optionally capped at
``--max-concurrency`` requests in flight. Reported, as vLLM's ``benchmarks/benchmark_serving.py``
does: request and token throughput, and the mean, median and p99 of

- TTFT: request sent to first streamed text;
- TPOT: (end - first text) / (output tokens - 1), per request;
- ITL: gap between two streamed chunks that carry text (a chunk can hold several tokens when
  the client reads slower than the engine steps);
- E2E: request sent to ``[DONE]``;

and the failed requests (HTTP error, error event, or a token count other than asked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx


@dataclass
class RequestResult:
    """Timings of one request, in seconds from its send time."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    e2e: Optional[float] = None
    error: Optional[str] = None

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, url: str, model: Optional[str], prompt: list[int],
               output_len: int) -> RequestResult:
    result = RequestResult(len(prompt))
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                now = time.perf_counter() - start
                if payload == "[DONE]":
                    result.e2e = now
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk["choices"]):
                    if result.ttft is None:
                        result.ttft = now
                    result.chunk_times.append(now)
    except httpx.HTTPError as exc:
        result.error = repr(exc)
        return result
    if result.e2e is None:
        result.error = "the stream ended without [DONE]"
    elif result.output_tokens != output_len:
        result.error = f"generated {result.output_tokens} tokens, asked {output_len}"
    return result


async def run(args: argparse.Namespace, workload) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        async def one(request) -> RequestResult:
            if semaphore is None:
                return await send(client, url, args.model, request.prompt_token_ids, request.output_len)
            async with semaphore:
                return await send(client, url, args.model, request.prompt_token_ids, request.output_len)

        tasks = []
        start = time.perf_counter()
        for request in workload:
            tasks.append(asyncio.create_task(one(request)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (NaN when empty)."""
    if not values:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": 1000 * statistics.fmean(values), "median_ms": 1000 * statistics.median(values),
            "p99_ms": 1000 * p99}


def report(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    itls = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
        "request_throughput_per_s": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (output_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "ttft": summary([r.ttft for r in done if r.ttft is not None]),
        "tpot": summary([r.tpot for r in done if r.tpot is not None]),
        "itl": summary(itls),
        "e2e": summary([r.e2e for r in done]),
    }


def print_report(stats: dict, args: argparse.Namespace) -> None:
    print(f"request rate {args.request_rate} req/s, max concurrency {args.max_concurrency or 'none'}")
    print(f"duration {stats['duration_s']:.1f} s, completed {stats['completed']}, failed {stats['failed']}")
    for error in stats["errors"]:
        print(f"  error: {error}")
    print(f"request throughput {stats['request_throughput_per_s']:.2f} req/s, output "
          f"{stats['output_tokens_per_s']:.1f} tokens/s, total {stats['total_tokens_per_s']:.1f} tokens/s")
    print(f"{'':6}{'mean ms':>10}{'median ms':>11}{'p99 ms':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = stats[name]
        print(f"{name.upper():6}{s['mean_ms']:10.1f}{s['median_ms']:11.1f}{s['p99_ms']:10.1f}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokenizer-model", default=None,
                        help="model whose tokenizer builds the prompts (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate in requests/s (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival gaps")
    parser.add_argument("--result-json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")

    from pagedllm.benchmarks.throughput import build_workload
    from pagedllm.models.loader import load_tokenizer, resolve_model_path

    workload = build_workload(load_tokenizer(resolve_model_path(args.tokenizer_model)), args.num_requests, args.seed)
    results, duration = asyncio.run(run(args, workload))
    stats = report(results, duration)
    print_report(stats, args)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), **stats}, f, indent=2)
    return 0 if stats["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
