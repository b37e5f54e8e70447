"""Tensor parallelism against one process: throughput and single-stream decode of one engine
configuration, with the all-reduces' count, bytes and time per step; and a gloo all-reduce
and shared-memory all-reduce micro-benchmark (2 processes, one CPU each) over message sizes.

    .venv/bin/python bench/tensor_parallel.py --model qwen2.5-coder-0.5b --threads 2
    .venv/bin/python bench/tensor_parallel.py --model qwen2.5-coder-0.5b --tensor-parallel-size 2 --tp-cores "0;1"
    .venv/bin/python bench/tensor_parallel.py --allreduce-micro

The workload is ``pagedllm bench throughput``'s (prompts cut from the shipped text, greedy,
``ignore_eos``), made small (``--num-requests``, shorter lengths) for a 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing
import os
import statistics
import time

import torch
import torch.distributed as dist

from pagedllm import LLM, EngineArgs
from pagedllm.benchmarks.throughput import TEXT_PATH, build_workload, run_pagedllm, single_stream_pagedllm
from pagedllm.distributed.parallel_state import all_reduce_stats
from pagedllm.distributed.shm_all_reduce import ShmAllReduce, create_shm_file

MICRO_SIZES = (896 * 4, 16 * 896 * 4, 256 * 896 * 4, 151936 // 2 * 4, 16 * 151936 // 2 * 4)


def _steps(llm) -> int:
    return llm.llm_engine.make_stats().iteration.step


def _report(name: str, llm, steps_before: int, elapsed: float) -> None:
    steps = _steps(llm) - steps_before
    calls, nbytes, seconds = all_reduce_stats.calls, all_reduce_stats.bytes, all_reduce_stats.seconds
    print(f"  {name}: {steps} steps, {elapsed / steps * 1000:.1f} ms/step; all-reduce per step: "
          f"{calls / steps:.0f} calls, {nbytes / steps / 1024:.1f} KiB, {seconds / steps * 1000:.2f} ms "
          f"({seconds / elapsed:.1%} of the time)")


def run_engine(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        workload = build_workload(llm.get_tokenizer(), args.num_requests, 0, (32, 256), (16, 64))
        run_pagedllm(llm, workload[:2])  # warm-up
        all_reduce_stats.reset()
        before = _steps(llm)
        result = run_pagedllm(llm, workload)
        print(f"TP={engine_args.tensor_parallel_size}, {torch.get_num_threads()} threads (rank 0), "
              f"dtype {llm.llm_engine.model.dtype}:")
        print("  " + result.line("workload"))
        _report("workload", llm, before, result.elapsed_s)
        prompt = llm.get_tokenizer().encode(TEXT_PATH.read_text(), add_special_tokens=False)[:256]
        all_reduce_stats.reset()
        before = _steps(llm)
        start = time.perf_counter()
        ttft, rate = single_stream_pagedllm(llm, prompt, 64)
        print(f"  single stream: 256-token prompt, time to first token {ttft * 1000:.0f} ms, "
              f"decode {rate:.1f} tokens/s")
        _report("single stream", llm, before, time.perf_counter() - start)
    finally:
        llm.llm_engine.shutdown()


def _micro_rank(rank: int, port: int, shm_path: str, repeats: int, results) -> None:
    import os
    os.sched_setaffinity(0, [rank])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    shm = ShmAllReduce(shm_path, rank, 2, lambda: True, 60.0)
    for name, all_reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce_)):
        for size in MICRO_SIZES:
            x = torch.ones(size // 4)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                all_reduce(x)
                times.append(time.perf_counter() - start)
            if rank == 0:
                results[name, size] = (statistics.median(times), statistics.mean(times))
    shm.close()
    dist.destroy_process_group()


def allreduce_micro(repeats: int = 200) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm_path = f"/dev/shm/pagedllm-bench-{port}"
    create_shm_file(shm_path, 2)
    context = multiprocessing.get_context("spawn")
    results = context.Manager().dict()
    ranks = [context.Process(target=_micro_rank, args=(rank, port, shm_path, repeats, results)) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    os.unlink(shm_path)
    print(f"all-reduce of 2 ranks (1 CPU each, fp32; gloo on loopback, pagedllm's shared memory), "
          f"{repeats} calls after a barrier each: median / mean")
    for size in MICRO_SIZES:
        print(f"  {size / 1024:9.1f} KiB: " + ", ".join(
            f"{name} {results[name, size][0] * 1e6:7.0f} / {results[name, size][1] * 1e6:7.0f} us"
            for name in ("gloo", "shm")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of a TP=1 engine")
    parser.add_argument("--allreduce-micro", action="store_true", help="only the gloo micro-benchmark")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    if args.allreduce_micro:
        allreduce_micro()
        return
    run_engine(args, EngineArgs.from_cli_args(args))


if __name__ == "__main__":
    main()
