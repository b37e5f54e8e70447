"""Write a synthetic chat trace for ``pagedllm plan`` (the README's example).

Poisson arrivals at ``--rate`` requests/s; 60 % of the requests start with one of 3 system
prompts of 256 tokens (a ``prefix_id``); prompt lengths are log-normal (median ~250 tokens,
capped at 6,000), outputs uniform in 16-256 tokens. Seeded, so the same command writes the
same file.

    .venv/bin/python bench/make_trace.py --requests 200 --rate 0.2 > trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.2, help="mean arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    arrival = 0.0
    for _ in range(args.requests):
        prompt = min(6000, max(8, int(rng.lognormvariate(5.5, 0.9))))
        request = {"arrival": round(arrival, 3), "prompt_tokens": prompt, "output_tokens": rng.randint(16, 256)}
        if rng.random() < 0.6:
            request["prompt_tokens"] = max(prompt, 256 + 8)
            request.update(prefix_id=f"system-{rng.randrange(3)}", prefix_tokens=256)
        print(json.dumps(request))
        arrival += rng.expovariate(args.rate)


if __name__ == "__main__":
    main()
