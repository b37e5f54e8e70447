"""Serving N LoRA adapters from one process against one process per adapter, on the same cores.

    python bench/lora_serving.py [--adapters 8] [--requests-per-adapter 8] [--max-tokens 64]
                                 [--prompt-tokens 128] [--rank 16] [--dtype bfloat16] [--model PATH]

Writes N random rank-``--rank`` PEFT adapters (every projection targeted) for the model, then
runs the same offline workload (``--requests-per-adapter`` greedy requests per adapter, random
prompts, ``ignore_eos``) two ways, alternated:

- one process: one engine with ``enable_lora``, ``max_loras = N``, all requests added at once
  (rows of every adapter in each step);
- one process per adapter, all started together: each an engine with its one adapter, its
  requests added at once, ``torch`` threads = cores / N (at least 1).

Prints wall seconds from the start of generation to the last token, generated tokens per
second, the sum of the processes' peak RSS and the ratio. Model loading is left out of the
times (each process loads before a barrier). For an idle machine: the numbers are only
meaningful when nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) with random A/B."""
    from safetensors.torch import save_file

    from pagedllm.lora.models import module_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (in_features, out_features) in module_shapes(config).items():
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": TARGETS, "bias": "none"}))


def run_engine(args, adapter_paths: list[str], prompts: list[list[int]], threads: int, barrier, results) -> None:
    """One engine serving ``adapter_paths`` (request i uses adapter i mod N); puts
    ``(seconds, generated tokens, peak RSS bytes)`` on ``results``."""
    torch.set_num_threads(threads)
    from pagedllm import LLMEngine, LoRARequest, SamplingParams
    from pagedllm.config import EngineArgs

    engine = LLMEngine(EngineArgs.from_kwargs(model=args.model, dtype=args.dtype, enable_lora=True,
                                              max_loras=len(adapter_paths), max_lora_rank=args.rank,
                                              max_num_seqs=max(len(prompts), 1),
                                              kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
                                              max_model_len=args.prompt_tokens + args.max_tokens + 16))
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapter_paths)]
    for lora in loras:
        engine.add_lora(lora)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    barrier.wait()
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params, lora_request=loras[index % len(loras)])
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
    results.put((time.perf_counter() - start, generated, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def measure(args, groups: list[tuple[list[str], list[list[int]]]], threads: int) -> tuple[float, int, int]:
    """Start one process per group at once; ``(wall seconds, tokens, summed peak RSS)``."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(groups) + 1), context.Queue()
    processes = [context.Process(target=run_engine, args=(args, paths, prompts, threads, barrier, results))
                 for paths, prompts in groups]
    for process in processes:
        process.start()
    barrier.wait()
    start = time.perf_counter()
    outcomes = [results.get() for _ in processes]
    wall = time.perf_counter() - start
    for process in processes:
        process.join()
    return wall, sum(o[1] for o in outcomes), sum(o[2] for o in outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests-per-adapter", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per engine (MiB)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated runs of each way (best kept)")
    parser.add_argument("--cores", type=int, default=None,
                        help="cores to share out (default: this process's CPU affinity)")
    args = parser.parse_args()

    from pagedllm.models.loader import load_checkpoint, resolve_model_path

    config, _ = load_checkpoint(resolve_model_path(args.model))
    rng = random.Random(0)
    n = args.adapters
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(n * args.requests_per_adapter)]
    cores = args.cores or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as root:
        paths = [str(Path(root) / f"adapter{i}") for i in range(n)]
        for i, path in enumerate(paths):
            write_adapter(Path(path), config, args.rank, seed=i)
        one = [(paths, prompts)]
        # Request i uses adapter i mod n in both ways.
        per_adapter = [([paths[i]], prompts[i::n]) for i in range(n)]
        best = {}
        for _ in range(args.rounds):
            for name, groups, threads in (("one process, all adapters", one, cores),
                                          ("one process per adapter", per_adapter, max(1, cores // n))):
                result = measure(args, groups, threads)
                if name not in best or result[0] < best[name][0]:
                    best[name] = result
    print(f"{n} adapters (rank {args.rank}), {len(prompts)} requests of {args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} generated each, {cores} cores; best of {args.rounds} alternated rounds")
    print("| way | seconds | generated tokens/s | summed peak RSS (MiB) |")
    print("|---|---|---|---|")
    for name, (wall, tokens, rss) in best.items():
        print(f"| {name} | {wall:.2f} | {tokens / wall:.1f} | {rss / 2**20:.0f} |")
    one_time, many_time = best["one process, all adapters"][0], best["one process per adapter"][0]
    print(f"per-adapter processes / one process (time): {many_time / one_time:.2f}")


if __name__ == "__main__":
    main()
