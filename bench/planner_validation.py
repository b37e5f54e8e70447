"""Does ``pagedllm plan`` predict the real engine? (issue 16's validation)

Two workloads, each replayed by the planner and run by the real engine (SmolLM2, default
dtype) with the same trace and configuration:

1. **throughput**: the 64 requests of ``pagedllm bench throughput`` (prompts 32-512 tokens
   cut from the shipped text, outputs 32-256), all arriving at once, prefix caching off, a
   16,384-token KV cache (1,024 blocks of 16; ``bench/memory.py``'s budget), so that
   requests are preempted.
2. **shared prefix**: 48 requests over 4 system prompts of 256 tokens each, a unique suffix of
   16-96 tokens and 16-96 output tokens, prefix caching on, 384 blocks of 16; once all
   arriving at t=0, once as a Poisson process (``--rate`` requests/s, which the engine serves
   in real time: which step a request joins then depends on how well the cost model predicts
   the machine's speed at that moment).

For each it prints predicted and measured peak blocks in use, preemptions, peak and mean
concurrency, prefix-cache hits, elapsed time and output throughput. The engine is measured
from outside: its scheduler's ``schedule`` is wrapped to read the blocks in use and the
running batch right after each schedule (the replay's measuring point).

    .venv/bin/python bench/planner_validation.py [--cost-model FILE] [--rate 1.5]

The cost model is calibrated first (or read from ``--cost-model`` if that file exists).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from pagedllm.benchmarks.throughput import TEXT_PATH, build_workload
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.planner.cost_model import CostModel, calibrate
from pagedllm.planner.plan import CALIBRATION_KV_BYTES
from pagedllm.planner.replay import PlanConfig, replay, summarize
from pagedllm.planner.trace import TraceRequest
from pagedllm.sampling_params import SamplingParams


def throughput_trace(tokenizer) -> list[TraceRequest]:
    return [TraceRequest(f"t{index}", 0.0, tuple(r.prompt_token_ids), r.output_len, None, index + 1)
            for index, r in enumerate(build_workload(tokenizer))]


def shared_prefix_trace(tokenizer, rate: Optional[float], num_requests: int = 48, seed: int = 0) -> list[TraceRequest]:
    """Requests over 4 system prompts of 256 tokens; all at t=0 when ``rate`` is None, else
    Poisson arrivals at ``rate`` requests/s."""
    tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    rng = random.Random(seed)

    def cut(length: int) -> list[int]:
        offset = rng.randrange(len(tokens))
        return [tokens[(offset + i) % len(tokens)] for i in range(length)]

    prefixes = [cut(256) for _ in range(4)]
    trace, arrival = [], 0.0
    for index in range(num_requests):
        group = rng.randrange(len(prefixes))
        trace.append(TraceRequest(f"s{index}", round(arrival, 4), tuple(prefixes[group] + cut(rng.randint(16, 96))),
                                  rng.randint(16, 96), f"sys{group}", index + 1))
        arrival += rng.expovariate(rate) if rate else 0.0
    return trace


def run_engine(engine: LLMEngine, trace: list[TraceRequest]) -> dict:
    """Serve ``trace`` on ``engine`` in real time (a request is added once its arrival time
    has passed); measure what the replay predicts."""
    scheduler, manager = engine.scheduler, engine.kv_cache_manager
    schedule = scheduler.schedule
    samples: list[tuple[int, int, float]] = []

    def measuring_schedule():
        output = schedule()
        if not output.is_empty:
            samples.append((scheduler.num_running, manager.block_pool.num_used_blocks, time.perf_counter()))
        return output

    preemptions, hits = scheduler.num_preemptions, manager.prefix_cache_hits
    scheduler.schedule = measuring_schedule
    params = {r.request_id: SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, temperature=0.0) for r in trace}
    start = time.perf_counter()
    index = 0
    try:
        while index < len(trace) or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            if not engine.has_unfinished_requests() and trace[index].arrival_time > now:
                time.sleep(trace[index].arrival_time - now)
                now = trace[index].arrival_time
            while index < len(trace) and trace[index].arrival_time <= now:
                request = trace[index]
                engine.add_request(request.request_id, list(request.prompt_token_ids), params[request.request_id])
                index += 1
            engine.step()
    finally:
        del scheduler.schedule
    end = time.perf_counter()
    # Concurrency weighted by time, each sample lasting until the next schedule.
    stamps = [stamp for _, _, stamp in samples] + [end]
    mean_running = sum(running * (stamps[i + 1] - stamps[i]) for i, (running, _, _) in enumerate(samples)) / (end - start)
    return {"peak_blocks": max(blocks for _, blocks, _ in samples), "preemptions": scheduler.num_preemptions - preemptions,
            "peak_concurrency": max(running for running, _, _ in samples), "mean_concurrency": mean_running,
            "prefix_hits": manager.prefix_cache_hits - hits, "elapsed": end - start,
            "throughput": sum(r.output_tokens for r in trace) / (end - start), "steps": len(samples)}


def predict(trace: list[TraceRequest], config: PlanConfig, cost_model: CostModel) -> dict:
    result = replay(trace, config, cost_model)
    m = summarize(result)
    return {"peak_blocks": m.peak_blocks, "preemptions": m.num_preemptions, "peak_concurrency": m.peak_concurrency,
            "mean_concurrency": m.mean_concurrency, "prefix_hits": m.prefix_cache_hit_tokens, "elapsed": m.span,
            "throughput": m.throughput, "steps": len(result.steps)}


def report(name: str, predicted: dict, measured: dict) -> None:
    print(f"\n{name}")
    print(f"| {'figure':<22} | {'predicted':>10} | {'measured':>10} | {'difference':>10} |")
    print(f"|{'-' * 24}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    for key in ("peak_blocks", "preemptions", "peak_concurrency", "mean_concurrency", "prefix_hits", "steps",
                "elapsed", "throughput"):
        p, m = predicted[key], measured[key]
        difference = "0.0 %" if p == m else (f"{(p - m) / m:+.1%}" if m else "n/a")
        fmt = (lambda v: f"{v:.2f}") if isinstance(p, float) or isinstance(m, float) else str
        print(f"| {key.replace('_', ' '):<22} | {fmt(p):>10} | {fmt(m):>10} | {difference:>10} |")


def fresh_engine(model, tokenizer, **kwargs) -> LLMEngine:
    engine = LLMEngine(EngineArgs.from_kwargs(**kwargs), model=model, tokenizer=tokenizer)
    # Warm-up: the first steps pay page faults in the new KV pool.
    for index in range(2):
        engine.add_request(f"warm{index}", list(range(100 + index, 164 + index)),
                           SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-model", type=Path, default=None, help="read if it exists, else calibrate and write")
    parser.add_argument("--rate", type=float, default=1.5, help="arrival rate of the shared-prefix workload (req/s)")
    parser.add_argument("--skip", choices=["throughput", "shared-prefix"], default=None)
    args = parser.parse_args()

    calibration_engine = LLMEngine(EngineArgs.from_kwargs(kv_cache_memory_bytes=CALIBRATION_KV_BYTES,
                                                          enable_prefix_caching=False, max_num_seqs=64))
    if args.cost_model is not None and args.cost_model.exists():
        cost_model = CostModel.load(args.cost_model)
    else:
        cost_model = calibrate(calibration_engine, log=print)
        if args.cost_model is not None:
            cost_model.save(args.cost_model)
    calibration = cost_model.calibration
    print(f"cost model: {calibration.get('steps')} steps measured in {calibration.get('seconds')} s on "
          f"{calibration.get('cpu')}, torch threads {calibration.get('threads')}; median step error "
          f"{calibration.get('median_relative_error', 0):.1%}; torch threads now {torch.get_num_threads()}")
    model, tokenizer = calibration_engine.model, calibration_engine.tokenizer
    del calibration_engine

    if args.skip != "throughput":
        trace = throughput_trace(tokenizer)
        config = PlanConfig(max_model_len=2048, num_blocks=1024, block_size=16, max_num_seqs=256,
                            max_num_batched_tokens=2048, enable_prefix_caching=False)
        engine = fresh_engine(model, tokenizer, num_gpu_blocks_override=1024, max_model_len=2048,
                              enable_prefix_caching=False)
        report("throughput workload: 64 requests at t=0, 1,024 blocks of 16, prefix caching off",
               predict(trace, config, cost_model), run_engine(engine, trace))
        del engine
    if args.skip != "shared-prefix":
        config = PlanConfig(max_model_len=2048, num_blocks=384, block_size=16, max_num_seqs=256,
                            max_num_batched_tokens=2048, enable_prefix_caching=True)
        for rate in (None, args.rate):
            trace = shared_prefix_trace(tokenizer, rate)
            engine = fresh_engine(model, tokenizer, num_gpu_blocks_override=384, max_model_len=2048,
                                  enable_prefix_caching=True)
            arrivals = "at t=0" if rate is None else f"Poisson {rate} req/s over {trace[-1].arrival_time:.1f} s"
            report(f"shared-prefix workload: 48 requests over 4 prefixes of 256 tokens, {arrivals}, "
                   "384 blocks of 16, prefix caching on", predict(trace, config, cost_model), run_engine(engine, trace))
            del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
