"""Dense matmul three ways: ``F.linear`` by a ``[out, in]`` weight, ``torch.mm`` by a
``[in, out]`` one, and oneDNN's ``_linear_pointwise`` by a weight packed once.

    .venv/bin/python bench/linear_layout.py [--threads 2] [--dtype bfloat16] [--rows 1 8 16 32 64 2048]

For SmolLM2-135M's four per-layer projections (QKV 576->960, O 576->576, gate/up 576->3072,
down 1536->576) it times one layer's four matmuls each way at each row count, alternating them
in one process, and prints ms for all 30 layers and the ratios to ``torch.mm``; then the LM
head (576->49152) by mm and packed. ``pagedllm/layers/linear.py`` packs weights because of
this table (it stored them transposed for ``torch.mm`` before).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
NUM_LAYERS = 30


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 128, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{torch.get_num_threads()} threads, {args.dtype}; ms per step (30 layers) and per LM head call")
    weights = {shape: torch.randn(shape).to(dtype) for shape in LAYER_SHAPES + [(49152, 576)]}
    transposed = {shape: w.t().contiguous() for shape, w in weights.items()}
    packed = {shape: torch.ops.mkldnn._reorder_linear_weight(w, 1) for shape, w in weights.items()}
    print(f"{'rows':>5} | {'F.linear':>9} | {'mm':>9} | {'packed':>9} | linear/mm | packed/mm | LM head mm / packed")
    head = (49152, 576)
    for rows in args.rows:
        inputs = {shape: torch.randn(rows, shape[1]).to(dtype) for shape in weights}
        linear = sum(median_ms(lambda s=s: F.linear(inputs[s], weights[s]), args.repeats) for s in LAYER_SHAPES)
        mm = sum(median_ms(lambda s=s: torch.mm(inputs[s], transposed[s]), args.repeats) for s in LAYER_SHAPES)
        pk = sum(median_ms(lambda s=s: packed_linear(inputs[s], packed[s]), args.repeats) for s in LAYER_SHAPES)
        head_mm = median_ms(lambda: torch.mm(inputs[head], transposed[head]), args.repeats)
        head_packed = median_ms(lambda: packed_linear(inputs[head], packed[head]), args.repeats)
        print(f"{rows:5d} | {NUM_LAYERS * linear:9.1f} | {NUM_LAYERS * mm:9.1f} | {NUM_LAYERS * pk:9.1f} | "
              f"{linear / mm:8.2f}x | {pk / mm:8.2f}x | {head_mm:.2f} / {head_packed:.2f}")


if __name__ == "__main__":
    main()
