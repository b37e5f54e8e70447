"""Prefill attention on this CPU: the exact C++ kernel (``csrc/prefill_attention.cpp``, K/V read
through the block table), in bf16 over a bf16 cache the AVX512_BF16 one
(``csrc/prefill_attention_bf16.cpp``) where the build has it, and torch's flash SDPA
(``prefill_attention_sdpa``: the cached prefix gathered, the KV heads repeated), for
SmolLM2-135M, SmolLM2-1.7B and Llama-3.1-8B head shapes, chunks of 150 to 2,048 queries over
contexts up to 16k.

Prints each one's median milliseconds (all alternated in one process) and their times over the
exact kernel's: below 1 is faster. ``layers/attention.py``'s ``SDPA_MIN_PAIRS`` and
``bf16_kernel_preferred`` are read off these ratios.

    .venv/bin/python bench/prefill_attention.py [--dtype bfloat16] [--kv-cache-dtype int8] [--repeats 5]
"""

import argparse
import time

import torch

from pagedllm.layers.attention import PrefillSequence, prefill_attention_sdpa
from pagedllm.layers.ops import native_ops, quantize_kv
from pagedllm.platform import cpu_flags

BLOCK_SIZE = 16
HEADS = [(9, 3, 64), (32, 32, 64), (32, 8, 128)]  # (heads, KV heads, head_dim)
CHUNKS = [(150, 150), (500, 500), (300, 500), (500, 2000), (2048, 2048), (1024, 4096), (2048, 4096),
          (2048, 16384)]  # (queries, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="int8: cache rows of int8 codes and a scale (auto: the compute dtype)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit("the C++ ops are not loaded")
    dtype = getattr(torch, args.dtype)
    bf16_kernel = torch.ops.pagedllm.prefill_attention_bf16_supported(64)
    print(f"{args.dtype}, KV cache {args.kv_cache_dtype}; amx_bf16: {'amx_bf16' in cpu_flags()}; threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    for heads, kv_heads, head_dim in HEADS:
        for q_len, ctx in CHUNKS:
            num_blocks = ctx // BLOCK_SIZE + 2
            key_cache, value_cache = (torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim).to(dtype)
                                      for _ in range(2))
            if args.kv_cache_dtype == "int8":
                key_cache, value_cache = quantize_kv(key_cache), quantize_kv(value_cache)
            table = torch.randperm(num_blocks)[:-(-ctx // BLOCK_SIZE)]
            query = torch.randn(q_len, heads, head_dim).to(dtype)
            # The chunk's own K/V (SDPA takes it from here when nothing is cached before the
            # chunk, the kernel always from the cache): random, as the timing does not care.
            key, value = (torch.randn(q_len, kv_heads, head_dim).to(dtype) for _ in range(2))
            seq, scale = PrefillSequence(0, q_len, ctx, table), head_dim ** -0.5
            kernel_args = (query, key_cache, value_cache, table, ctx, scale)
            runs = {"kernel": lambda: torch.ops.pagedllm.paged_prefill_attention(*kernel_args),
                    "sdpa": lambda: prefill_attention_sdpa(query, key, value, key_cache, value_cache, seq, scale)}
            if dtype == torch.bfloat16 and key_cache.dtype == dtype and bf16_kernel:
                runs["bf16"] = lambda: torch.ops.pagedllm.paged_prefill_attention_bf16(*kernel_args)
            times = {name: [] for name in runs}
            for fn in runs.values():
                fn()
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            ms = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
            flop = 4 * head_dim * heads * q_len * (ctx - q_len / 2)  # causal Q.K and P.V
            print(f"heads {heads}/{kv_heads} x {head_dim}, {q_len} x {ctx}: "
                  + ", ".join(f"{name} {t:.2f} ms ({flop / t / 1e6:.0f} GFLOP/s)" for name, t in ms.items())
                  + "; over kernel: " + ", ".join(f"{name} {ms[name] / ms['kernel']:.2f}" for name in ms
                                                  if name != "kernel"), flush=True)


if __name__ == "__main__":
    main()
