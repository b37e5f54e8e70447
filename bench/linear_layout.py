"""Dense matmul by a ``[out, in]`` weight (``F.linear``) vs a ``[in, out]`` one (``torch.mm``).

    python bench/linear_layout.py [--threads 2] [--rows 1 8 16 32 64 2048]

For SmolLM2-135M's four per-layer projections (QKV 576->960, O 576->576, gate/up 576->3072,
down 1536->576) it times one layer's four matmuls both ways at each row count, alternating the
two in one process, and prints ms for all 30 layers and the ratio; then the same for the LM head
(576->49152). ``pagedllm/layers/linear.py`` stores weights transposed because of this table.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 128, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, fp32; ms per step (30 layers) and per LM head call")
    weights = {shape: torch.randn(shape) for shape in LAYER_SHAPES + [(49152, 576)]}
    transposed = {shape: w.t().contiguous() for shape, w in weights.items()}
    print(f"{'rows':>5} | {'F.linear [out,in]':>17} | {'mm [in,out]':>11} | ratio | LM head linear / mm")
    for rows in args.rows:
        inputs = {shape: torch.randn(rows, shape[1]) for shape in weights}
        linear = sum(median_ms(lambda s=s: F.linear(inputs[s], weights[s]), args.repeats) for s in LAYER_SHAPES)
        mm = sum(median_ms(lambda s=s: torch.mm(inputs[s], transposed[s]), args.repeats) for s in LAYER_SHAPES)
        head = (49152, 576)
        head_linear = median_ms(lambda: F.linear(inputs[head], weights[head]), args.repeats)
        head_mm = median_ms(lambda: torch.mm(inputs[head], transposed[head]), args.repeats)
        print(f"{rows:5d} | {NUM_LAYERS * linear:17.1f} | {NUM_LAYERS * mm:11.1f} | {linear / mm:4.2f}x"
              f" | {head_linear:.2f} / {head_mm:.2f}")


if __name__ == "__main__":
    main()
