"""Decode attention over a bfloat16 and an int8 KV cache, alternated in one process.

    .venv/bin/python bench/kv_cache_dtype.py [--seqs 64] [--context 450] [--layers 30] [--rounds 4]

A decode batch at SmolLM2's shapes (9 query heads, 3 KV heads of 64) reads ``--layers`` layers'
caches in turn, as a step does: 30 layers of 64 x 450 tokens are 0.66 GiB in bf16, far past the
L3 cache; one layer alone (``1 layer``) stays in it and shows the kernel's compute floor. Block
tables are laid out three ways: each sequence's blocks consecutive (``seq``), handed out round
robin as decode growth does (``interleaved``), and shuffled, as a long-running server's pool
ends up (``rand``). The pools are in 2 MiB pages, as the engine's. Prints ms per layer (best of
3 calls) for every round, then the median ratio bf16 / int8 per layout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.huge_pages import huge_page_zeros
from pagedllm.layers.ops import native_ops, quantize_kv

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def make_cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    width = HEAD_DIM + 4 if dtype == torch.int8 else HEAD_DIM
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, width)
    cache = huge_page_zeros(num_blocks * BLOCK_SIZE * NUM_KV_HEADS * width * dtype.itemsize).view(dtype).view(shape)
    values = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache.copy_(quantize_kv(values) if dtype == torch.int8 else values.to(dtype))
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=450, help="tokens cached per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the C++ ops did not build")
    torch.manual_seed(0)
    per_seq = -(-args.context // BLOCK_SIZE)
    num_blocks = args.seqs * per_seq
    caches = {name: [(make_cache(num_blocks, dtype), make_cache(num_blocks, dtype)) for _ in range(args.layers)]
              for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8))}
    query = torch.randn(args.seqs, NUM_HEADS, HEAD_DIM).bfloat16()
    lens = torch.full((args.seqs,), args.context, dtype=torch.long)
    layouts = {"seq": torch.arange(num_blocks).view(args.seqs, per_seq),
               "interleaved": torch.arange(num_blocks).view(per_seq, args.seqs).t(),
               "rand": torch.randperm(num_blocks).view(args.seqs, per_seq)}
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for layout, table in layouts.items():
            table = table.contiguous()
            for name, layer_caches in caches.items():
                for layers in (1, args.layers):
                    best = float("inf")
                    for _ in range(3 if layers > 1 else 30):
                        start = time.perf_counter()
                        for key_cache, value_cache in layer_caches[:layers]:
                            ops.paged_decode_attention(query, key_cache, value_cache, table, lens, HEAD_DIM ** -0.5, 0)
                        best = min(best, (time.perf_counter() - start) / layers)
                    times.setdefault((layout, name, layers), []).append(best * 1e3)
    for (layout, name, layers), values in times.items():
        print(f"{layout:12} {name:5} {layers:3} layer(s): " + " ".join(f"{v:.2f}" for v in values) + " ms/layer")
    for layout in layouts:
        for layers in (1, args.layers):
            ratio = statistics.median(times[layout, "bf16", layers]) / statistics.median(times[layout, "int8", layers])
            print(f"{layout:12} {layers:3} layer(s): bf16 / int8 = {ratio:.2f}x")


if __name__ == "__main__":
    main()
