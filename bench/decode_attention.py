"""Decode attention at long context against a plain read of the same bytes, in one process.

    .venv/bin/python bench/decode_attention.py [--contexts 4096 16384 32768] [--rounds 5]
        [--block-sizes 16 64]

One sequence (batch 1) of a Llama-3 head shape (``--heads 24 --kv-heads 8 --head-dim 128``, the
3B's; the 8B's is 32 / 8 / 128) in a bf16 paged KV cache of ``block_size``-token blocks (16 unless
``--block-sizes`` names others; several are alternated within each round) laid out in a
shuffled order, as a long-running server's pool ends up. Two layers' caches alternate, so
that from 16k tokens on (64 MiB per layer and tensor) every call reads its K/V from DRAM.
Each round times ``paged_decode_attention`` (best of 3 calls per layer pair) and, as the
baseline, ``torch.sum`` over the same K and V tensors viewed as float32 (bf16 pairs: the same
bytes, read in order by torch's vectorized sum with the same threads). Prints ms per layer, GB/s and the ratio to the plain read (1.0: the
kernel reads as fast as a sum does), medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.huge_pages import huge_page_zeros
from pagedllm.layers.ops import native_ops
from pagedllm.platform import keep_freed_memory_mapped


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = huge_page_zeros(num_blocks * block_size * kv_heads * head_dim * 2).view(torch.bfloat16).view(shape)
    cache.copy_(torch.randn(shape).bfloat16())
    return cache


def best_per_layer(run, layers) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for key_cache, value_cache in layers:
            run(key_cache, value_cache)
        best = min(best, (time.perf_counter() - start) / len(layers))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16], help="tokens per KV block")
    args = parser.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the C++ ops did not build")
    keep_freed_memory_mapped()  # malloc as in the engine: a call's scratch reused, not unmapped
    torch.manual_seed(0)
    print(f"{args.heads} query heads, {args.kv_heads} KV heads of {args.head_dim}, bf16, batch 1, "
          f"{torch.get_num_threads()} threads")
    for context in args.contexts:
        query = torch.randn(1, args.heads, args.head_dim).bfloat16()
        scale = args.head_dim ** -0.5
        cases = []
        for block_size in args.block_sizes:
            num_blocks = -(-context // block_size)
            layers = [(make_cache(num_blocks, block_size, args.kv_heads, args.head_dim),
                       make_cache(num_blocks, block_size, args.kv_heads, args.head_dim)) for _ in range(2)]
            cases.append((block_size, layers, torch.randperm(num_blocks).view(1, num_blocks)))
        lens = torch.tensor([context])
        kernel = {block_size: [] for block_size in args.block_sizes}
        read = {block_size: [] for block_size in args.block_sizes}
        for _ in range(args.rounds):
            for block_size, layers, table in cases:
                kernel[block_size].append(best_per_layer(
                    lambda k, v: ops.paged_decode_attention(query, k, v, table, lens, scale, 0), layers))
                read[block_size].append(best_per_layer(
                    lambda k, v: (k.view(torch.float32).sum(), v.view(torch.float32).sum()), layers))
        for block_size, layers, _ in cases:
            nbytes = 2 * layers[0][0].nbytes
            ms, read_ms = statistics.median(kernel[block_size]), statistics.median(read[block_size])
            print(f"{context:6} tokens, block_size {block_size:3}: attention {ms * 1e3:6.2f} ms/layer "
                  f"({nbytes / ms / 1e9:5.1f} GB/s), plain read {read_ms * 1e3:6.2f} ms "
                  f"({nbytes / read_ms / 1e9:5.1f} GB/s): {read_ms / ms:.2f} of the read rate")

if __name__ == "__main__":
    main()
