"""Batched multi-LoRA against a per-adapter loop, over the 4 projections of a SmolLM2-135M layer
x 30 layers (each with its own weights, so that every weight streams from memory, as in a step).

    python bench/lora.py [--rows 8 32 512] [--adapters 8] [--rank 16] [--threads 2] [--repeats 7]

Rows are split evenly over ``--adapters`` adapters (every projection targeted, rank
``--rank``), plus as many rows again with no adapter. Two ways:

- batched (what the engine does, ``lora/layers.py``): the base projection once over all rows,
  then per adapter the shrink ``x_g @ A^T`` and expand ``@ B^T`` of its rows (one range each);
- per-adapter loop (one forward per adapter, what a server without batched LoRA runs): the
  base projection and the LoRA term separately for each adapter's rows, and once more for the
  rows of none.

For fp32 and bf16 compute and a dense, int8 and int4 base; prints ms per step (median of
``--repeats``, the two alternated) and the ratio loop / batched (> 1: batching wins).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization import Int4Linear, Int8Linear
from pagedllm.lora.layers import (FUSED_MODULES, ExpandSlice, LoRAContext, LoRALinear, PackedLoRA, add_lora,
                                  tile_lora)
from pagedllm.platform import keep_freed_memory_mapped

HIDDEN, Q, KV, INTERMEDIATE, NUM_LAYERS = 576, 576, 192, 1536, 30
SLICES = {"self_attn.qkv_proj": (HIDDEN, [Q, KV, KV]), "self_attn.o_proj": (Q, [HIDDEN]),
          "mlp.gate_up_proj": (HIDDEN, [INTERMEDIATE, INTERMEDIATE]), "mlp.down_proj": (INTERMEDIATE, [HIDDEN])}


def random_packed(generator: torch.Generator, in_features: int, out_sizes: list[int], rank: int,
                  dtype: torch.dtype) -> PackedLoRA:
    slices, out = [], 0
    for index, size in enumerate(out_sizes):
        b_t = (torch.randn(rank, size, generator=generator) * 0.01).to(dtype)
        slices.append(ExpandSlice(index * rank, (index + 1) * rank, out, out + size, b_t, 2.0))
        out += size
    a_t = (torch.randn(in_features, rank * len(out_sizes), generator=generator) * 0.01).to(dtype)
    packed = PackedLoRA(a_t, slices)
    return tile_lora(packed)  # as pack_adapter does: products on the tiles


def build_layers(base_kind: str, dtype: torch.dtype, num_adapters: int, rank: int):
    """30 layers of 4 ``LoRALinear``s over fresh base weights, and each adapter's packed LoRA."""
    generator = torch.Generator().manual_seed(0)
    context = LoRAContext()
    layers, adapters = [], [{} for _ in range(num_adapters)]
    for layer_index in range(NUM_LAYERS):
        for path in FUSED_MODULES:
            in_features, out_sizes = SLICES[path]
            weight = torch.randn(sum(out_sizes), in_features, generator=generator) * 0.02
            if base_kind == "dense":
                base = Linear(in_features, sum(out_sizes))
                base.set_weight(weight, dtype)
                base.pack()
            else:
                base = (Int8Linear if base_kind == "int8" else Int4Linear).from_float(weight, None)
            layers.append((LoRALinear(base, layer_index, path, context), in_features))
            for adapter in adapters:
                adapter[(layer_index, path)] = random_packed(generator, in_features, out_sizes, rank, dtype)
    return context, layers, adapters


def batched(context, layers, adapters, inputs, ranges) -> None:
    context.groups = [(adapter, slice(*r)) for adapter, r in zip(adapters, ranges)]
    for layer, in_features in layers:
        layer(inputs[in_features])
    context.groups = []


def per_adapter_loop(context, layers, adapters, inputs, ranges) -> None:
    for layer, in_features in layers:
        x = inputs[in_features]
        for adapter, (start, end) in zip(adapters, ranges):
            rows = x[start:end]
            add_lora(layer.base(rows), rows, [(adapter[layer.key], slice(0, end - start))])
        layer.base(x[ranges[-1][1]:])  # the rows of no adapter


def step_ms(function, repeats: int) -> list[float]:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 512])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--bases", nargs="+", default=["dense", "int8", "int4"])
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    keep_freed_memory_mapped()
    print(f"{args.adapters} adapters of rank {args.rank} on every projection, 30 SmolLM2-135M layers, "
          f"{torch.get_num_threads()} threads; half the rows have an adapter")
    print("| dtype | base | rows | batched ms | per-adapter loop ms | loop / batched |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for base_kind in args.bases:
                context, layers, adapters = build_layers(base_kind, dtype, args.adapters, args.rank)
                for num_rows in args.rows:
                    per_adapter = max(1, num_rows // (2 * args.adapters))
                    ranges = [(i * per_adapter, (i + 1) * per_adapter) for i in range(args.adapters)]
                    total = max(num_rows, ranges[-1][1] + 1)
                    inputs = {n: torch.randn(total, n).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
                    times = {"batched": [], "loop": []}
                    for _ in range(2):  # alternated
                        times["batched"] += step_ms(lambda: batched(context, layers, adapters, inputs, ranges),
                                                    args.repeats)
                        times["loop"] += step_ms(lambda: per_adapter_loop(context, layers, adapters, inputs, ranges),
                                                 args.repeats)
                    fast, slow = statistics.median(times["batched"]), statistics.median(times["loop"])
                    print(f"| {dtype_name} | {base_kind} | {total} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f} |",
                          flush=True)


if __name__ == "__main__":
    main()
