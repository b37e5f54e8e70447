"""Soak test of a running ``pagedllm serve``: many mixed requests, then checks that nothing leaked.

    pagedllm serve --port 8000 --api-key sk-local --kv-cache-memory-bytes 16000000 &
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --api-key sk-local --requests 2000 --concurrency 16

``--requests`` requests are sent by ``--concurrency`` clients, each drawn at random (seeded):

- ``/v1/completions`` or ``/v1/chat/completions``, streaming or not, on a short prompt cut from
  the shipped public-domain text;
- random sampling parameters: temperature (0 = greedy), top_p, top_k, min_p, max_tokens, n,
  stop strings, seed, penalties, logprobs / top_logprobs, ``stream_options.include_usage``;
- ``--disconnect-fraction`` of them hang up early: a stream after a few chunks, a plain
  request after a random delay (the server must abort them and free their blocks);
- ``--malformed-fraction`` of them have a bad body (not JSON, a field out of range, a wrong
  type, ...), which must be answered 400.

Checks (exit status 1 when one fails):

- no 5xx and every status as expected (200, or 400 for a malformed body; 429 counts as an
  error too: run the server without ``--max-waiting-requests``);
- no hang: every request got an answer (or its next stream chunk) within ``--timeout`` s;
- every answer is well formed: a stream ends with ``data: [DONE]`` and no error event, a
  plain answer has ``n`` choices with a finish reason;
- after the drain, ``/metrics`` reports 0 running, 0 waiting and 0 KV cache usage
  (``pagedllm:num_requests_running``, ``pagedllm:num_requests_waiting``,
  ``pagedllm:kv_cache_usage_perc``: blocks held by requests; cached-free ones do not count);
- the greedy output of a fixed prompt is the same before and after;
- the server's resident set size (``VmRSS`` of ``--pid``, or of the process listening on the
  URL's port) grows by at most ``--rss-tolerance`` between the middle (half of the requests
  done, after warm-up) and the end.

It only talks to a loopback address, and is bounded: ``--requests`` requests and at most
``--time-limit`` seconds of sending (what is left unsent is reported, and fails the run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ipaddress
import json
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

TEXT_PATH = Path(__file__).resolve().parents[1] / "pagedllm" / "data" / "public_domain.txt"
GREEDY_PROMPT = "The capital of France is"
GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc")


# --------------------------------------------------------------------------------- the server process
def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rss_mib(pid: int) -> Optional[float]:
    """Resident set size of ``pid`` in MiB (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def find_listening_pid(port: int) -> Optional[int]:
    """The process (of this user) with a listening TCP socket on ``port``, from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{inode}]")
        except OSError:
            continue
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


def port_of(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


# --------------------------------------------------------------------------------- requests
@dataclass
class Plan:
    """One request of the soak: what is sent and what must come back."""

    path: str
    body: object  # a dict, or raw bytes for a body that is not JSON
    stream: bool = False
    malformed: bool = False
    disconnect_after_chunks: Optional[int] = None  # streaming: hang up after this many chunks
    disconnect_after_s: Optional[float] = None  # not streaming: hang up after this long
    n: int = 1


def _prompt_words(rng: random.Random, words: list[str]) -> str:
    start = rng.randrange(len(words) - 40)
    return " ".join(words[start:start + rng.randint(3, 30)])


def random_plan(rng: random.Random, words: list[str], args: argparse.Namespace) -> Plan:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() < args.malformed_fraction:
        return Plan(path, malformed_body(rng, chat), malformed=True)
    text = _prompt_words(rng, words)
    body: dict = {"max_tokens": rng.randint(1, args.max_tokens)}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.2:
            body["messages"].insert(0, {"role": "system", "content": "You are terse."})
    else:
        body["prompt"] = text
    if rng.random() < 0.3:
        body["temperature"] = 0.0
    else:
        body["temperature"] = round(rng.uniform(0.1, 1.5), 2)
        if rng.random() < 0.5:
            body["top_p"] = round(rng.uniform(0.05, 1.0), 2)
        if rng.random() < 0.5:
            body["top_k"] = rng.choice([-1, 1, 5, 40])
        if rng.random() < 0.2:
            body["min_p"] = round(rng.uniform(0.0, 0.2), 2)
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(2**31)
    n = rng.choice([1, 1, 1, 2, 3])
    body["n"] = n
    if rng.random() < 0.3:
        body["stop"] = rng.sample(["\n", ".", " the", "and", ",", "!"], rng.randint(1, 3))
    if rng.random() < 0.2:
        body["presence_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.2:
        body["repetition_penalty"] = round(rng.uniform(0.9, 1.3), 2)
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
        else:
            body["logprobs"] = rng.randint(0, 5)
    if not chat and rng.random() < 0.05:
        body["echo"] = True
    stream = rng.random() < 0.5
    plan = Plan(path, body, stream=stream, n=n)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < args.disconnect_fraction:
        if stream:
            plan.disconnect_after_chunks = rng.randint(0, 3)
        else:
            plan.disconnect_after_s = rng.uniform(0.0, 1.0)
    return plan


def malformed_body(rng: random.Random, chat: bool) -> object:
    """A body the server must answer with 400."""
    good: dict = ({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    good["max_tokens"] = 4
    broken = rng.choice([
        lambda b: b"{not json",
        lambda b: b"",
        lambda b: json.dumps([1, 2, 3]).encode(),
        lambda b: {**b, "temperature": -1.0},
        lambda b: {**b, "top_p": 1.5},
        lambda b: {**b, "max_tokens": -3},
        lambda b: {**b, "n": 0},
        lambda b: {**b, "top_k": -7},
        lambda b: {**b, "stop": 17},
        lambda b: {**b, "max_tokens": "many"},
        lambda b: {**b, "presence_penalty": 9.0},
        lambda b: {k: v for k, v in b.items() if k not in ("prompt", "messages")},
        lambda b: {**b, "messages": [{"role": "robot", "content": "Hi"}]} if chat else {**b, "prompt": [-5, 3]},
        lambda b: {**b, "top_logprobs": 99, "logprobs": True} if chat else {**b, "logprobs": 99},
    ])
    return broken(good)


@dataclass
class Outcome:
    status: Optional[int] = None  # None: no HTTP status (hang, disconnect before headers, error)
    kind: str = "ok"  # ok | hang | disconnected | bad_status | bad_answer | transport_error
    detail: str = ""


async def execute(client: httpx.AsyncClient, base_url: str, plan: Plan) -> Outcome:
    url = base_url + plan.path
    kwargs = ({"content": plan.body, "headers": {"content-type": "application/json"}}
              if isinstance(plan.body, bytes) else {"json": plan.body})
    outcome = Outcome()
    try:
        if plan.stream:
            async with client.stream("POST", url, **kwargs) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    return _judge_error(plan, outcome, response.text)
                chunks, done = 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        return Outcome(200, "bad_answer", f"error event: {chunk['error'].get('message')}")
                    chunks += 1
                    if plan.disconnect_after_chunks is not None and chunks > plan.disconnect_after_chunks:
                        return Outcome(200, "disconnected")
                if not done:
                    return Outcome(200, "bad_answer", "the stream ended without [DONE]")
                return outcome
        if plan.disconnect_after_s is not None:
            try:
                response = await asyncio.wait_for(client.post(url, **kwargs), plan.disconnect_after_s)
            except asyncio.TimeoutError:
                return Outcome(None, "disconnected")
        else:
            response = await client.post(url, **kwargs)
        outcome.status = response.status_code
        if response.status_code != 200:
            return _judge_error(plan, outcome, response.text)
        if plan.malformed:
            return Outcome(200, "bad_status", "a malformed body was accepted")
        choices = response.json().get("choices", [])
        if len(choices) != plan.n or any(c.get("finish_reason") is None for c in choices):
            return Outcome(200, "bad_answer", f"{len(choices)} choices for n={plan.n}, or no finish_reason")
        return outcome
    except httpx.TimeoutException as exc:
        return Outcome(outcome.status, "hang", repr(exc))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome(outcome.status, "transport_error", repr(exc))


def _judge_error(plan: Plan, outcome: Outcome, text: str) -> Outcome:
    if plan.malformed and outcome.status == 400:
        try:
            ok = "message" in json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return outcome if ok else Outcome(400, "bad_answer", f"not OpenAI's error JSON: {text[:200]}")
    return Outcome(outcome.status, "bad_status", text[:200])


async def greedy_text(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.post(base_url + "/v1/completions", json={
        "prompt": GREEDY_PROMPT, "max_tokens": 32, "temperature": 0.0})
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


async def read_gauges(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    response = await client.get(base_url + "/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in GAUGES:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


# --------------------------------------------------------------------------------- the run
@dataclass
class SoakResult:
    sent: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    rss_mib: dict[str, Optional[float]] = field(default_factory=dict)
    rss_series: list[tuple[float, int, Optional[float]]] = field(default_factory=list)
    gauges: dict[str, float] = field(default_factory=dict)
    greedy_before: str = ""
    greedy_after: str = ""
    duration_s: float = 0.0


async def soak(args: argparse.Namespace, pid: Optional[int]) -> SoakResult:
    rng = random.Random(args.seed)
    words = TEXT_PATH.read_text().split()
    base_url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    result = SoakResult()
    sample = (lambda: rss_mib(pid)) if pid is not None else (lambda: None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        result.greedy_before = await greedy_text(client, base_url)
        result.rss_mib["start"] = sample()
        plans = [random_plan(rng, words, args) for _ in range(args.requests)]
        start = time.monotonic()
        deadline = start + args.time_limit
        next_index = 0
        done = 0
        middle = args.requests // 2

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < len(plans) and time.monotonic() < deadline:
                plan = plans[next_index]
                next_index += 1
                result.sent += 1
                outcome = await execute(client, base_url, plan)
                result.kinds[outcome.kind] += 1
                result.statuses[outcome.status if outcome.status is not None else "none"] += 1
                if outcome.detail:
                    result.examples.setdefault(outcome.kind, [])
                    if len(result.examples[outcome.kind]) < 3:
                        result.examples[outcome.kind].append(outcome.detail)
                done += 1
                if done == middle:
                    result.rss_mib["middle"] = sample()
                if done % args.progress_every == 0:
                    rss = sample()
                    result.rss_series.append((round(time.monotonic() - start, 1), done, rss))
                    print(f"  {done} done in {time.monotonic() - start:.0f} s, RSS "
                          f"{'?' if rss is None else f'{rss:.0f} MiB'}, {dict(result.kinds)}", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        result.duration_s = time.monotonic() - start
        # Gauges are updated on the engine thread after each step; give aborts a moment to land.
        for _ in range(int(args.drain_wait / 0.5) + 1):
            result.gauges = await read_gauges(client, base_url)
            if all(result.gauges.get(name, 1.0) == 0 for name in GAUGES):
                break
            await asyncio.sleep(0.5)
        result.greedy_after = await greedy_text(client, base_url)
        result.rss_mib["end"] = sample()
    return result


def checks(result: SoakResult, args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    fivexx = sum(count for status, count in result.statuses.items() if isinstance(status, int) and status >= 500)
    rows = [
        ("all requests sent", result.sent == args.requests, f"{result.sent} of {args.requests}"),
        ("no 5xx", fivexx == 0, f"{fivexx}"),
        ("no hang", result.kinds["hang"] == 0, f"{result.kinds['hang']} (timeout {args.timeout:g} s)"),
        ("every answer as expected",
         sum(result.kinds[k] for k in ("bad_status", "bad_answer", "transport_error")) == 0,
         ", ".join(f"{k} {result.kinds[k]}" for k in ("bad_status", "bad_answer", "transport_error"))),
        ("gauges 0 after the drain", all(result.gauges.get(name) == 0 for name in GAUGES),
         ", ".join(f"{name.split(':')[1]} {result.gauges.get(name)}" for name in GAUGES)),
        ("greedy output unchanged", result.greedy_before == result.greedy_after,
         f"{result.greedy_before!r}" + ("" if result.greedy_before == result.greedy_after
                                        else f" became {result.greedy_after!r}")),
    ]
    middle, end = result.rss_mib.get("middle"), result.rss_mib.get("end")
    if middle is not None and end is not None:
        growth = (end - middle) / middle
        rows.append(("RSS flat after warm-up", growth <= args.rss_tolerance,
                     f"middle {middle:.0f} -> end {end:.0f} MiB ({100 * growth:+.1f} %, "
                     f"tolerance {100 * args.rss_tolerance:g} %)"))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pid", type=int, default=None,
                        help="server process whose RSS is watched (default: the one listening on the URL's port)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens is drawn from 1..this")
    parser.add_argument("--disconnect-fraction", type=float, default=0.09)
    parser.add_argument("--malformed-fraction", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds without an answer (or the next stream chunk) that count as a hang")
    parser.add_argument("--time-limit", type=float, default=3600.0, help="stop sending after this many seconds")
    parser.add_argument("--drain-wait", type=float, default=15.0,
                        help="seconds to wait for the gauges to reach 0 after the last request")
    parser.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="largest allowed RSS growth from the middle to the end (fraction)")
    parser.add_argument("--progress-every", type=int, default=250, help="print a line every this many requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if not is_loopback(args.url):
        parser.error(f"--url must be a loopback address (127.0.0.0/8, ::1, localhost), got {args.url}")
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    pid = args.pid if args.pid is not None else find_listening_pid(port_of(args.url))
    if pid is None:
        print("warning: no server process found for the URL's port: RSS is not watched (give --pid)")

    print(f"soak: {args.requests} requests, concurrency {args.concurrency}, against {args.url} "
          f"(pid {pid}), {socket.gethostname()}")
    result = asyncio.run(soak(args, pid))
    rows = checks(result, args)
    rss = result.rss_mib
    print(f"duration {result.duration_s:.0f} s ({result.sent / max(result.duration_s, 1e-9):.1f} req/s)")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(result.kinds.items())))
    print("statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(result.statuses.items(), key=str)))
    print("RSS MiB:  " + ", ".join(f"{k} {'?' if v is None else f'{v:.0f}'}" for k, v in rss.items()))
    for kind, details in result.examples.items():
        for detail in details:
            print(f"  {kind}: {detail}")
    for name, ok, detail in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "pid": pid, "sent": result.sent, "duration_s": result.duration_s,
                       "outcomes": dict(result.kinds), "statuses": {str(k): v for k, v in result.statuses.items()},
                       "rss_mib": rss, "rss_series": result.rss_series, "gauges": result.gauges,
                       "greedy_before": result.greedy_before, "greedy_after": result.greedy_after,
                       "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in rows]}, f, indent=2)
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
