"""The 120 layer matmuls of a SmolLM2-135M step, each with its own weight (so that, as in a real
step, every weight streams from memory), two ways each, alternated in one process.

    .venv/bin/python bench/decode_matmuls.py [--rows 1 4 16 64 512 2048] [--threads 2] [--repeats 9]

- bf16: oneDNN's packed matmul (``mkldnn::_linear_pointwise``, what ``Linear.pack`` did for
  bf16 before) against ``bf16_linear`` over ``block_bf16`` tiles in 2 MiB pages (what it does
  now where the C++ ops are built).
- w8a8: ``torch._int_mm`` on ``[N, K]`` codes and int8 rows alone against the whole
  ``w8a8_linear`` op (quantize, integer product over ``block_w8a8`` codes, dequantize).
- 4-bit: ``int4_linear`` (fp32 activations, codes widened to fp32 in registers; up to 64 rows,
  the engine dequantizes beyond) against ``w4a8_linear`` (int8 activations, integer dot
  products, every row count).

Prints ms per step (all 120 matmuls; best of two alternated runs, each the median of
``--repeats``) and the ratio. Needs the C++ ops. Results go into bench/README.md by hand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.huge_pages import move_weights_to_huge_pages
from pagedllm.layers.linear import block_bf16
from pagedllm.layers.ops import native_ops
from pagedllm.layers.quantization import Int4Linear, W4A8Linear, block_w8a8, quantize_int4
from pagedllm.platform import keep_freed_memory_mapped

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
NUM_LAYERS = 30


def step_ms(matmuls, repeats: int) -> float:
    """Median ms of one pass over every ``matmuls`` closure, after one warm-up pass."""
    for matmul in matmuls:
        matmul()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for matmul in matmuls:
            matmul()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512, 2048])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    keep_freed_memory_mapped()  # malloc as in the engine: freed activations reused, not unmapped
    ops = native_ops()
    if ops is None:
        raise SystemExit("the C++ ops are not built here")
    g = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS
    weights = [torch.randn(shape, generator=g).bfloat16() for shape in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    arena = torch.nn.Module()  # the tiles and the int8 codes, placed as the model loader places them
    arena.tiles = torch.nn.ParameterList([torch.nn.Parameter(block_bf16(w), requires_grad=False) for w in weights])
    arena.codes = torch.nn.ParameterList([torch.nn.Parameter(torch.randint(-127, 128, shape, generator=g,
                                                                           dtype=torch.int8), requires_grad=False)
                                          for shape in shapes])
    arena.blocked = torch.nn.ParameterList([torch.nn.Parameter(block_w8a8(c), requires_grad=False) for c in arena.codes])
    int4 = [quantize_int4(w.float(), half_scales=True) for w in weights]
    arena.int4 = torch.nn.ModuleList([Int4Linear(w, None) for w in int4])
    arena.w4a8 = torch.nn.ModuleList([W4A8Linear(w, None) for w in int4])
    move_weights_to_huge_pages(arena)
    scales = [torch.rand(n, generator=g) for n, _ in shapes]
    smooth_inv = {k: torch.ones(1, k) for _, k in LAYER_SHAPES}
    print(f"{torch.get_num_threads()} threads; ms per step of {len(shapes)} matmuls (best of 2 alternated)")
    print(f"{'rows':>5} | {'bf16 packed':>11} | {'bf16 tiles':>10} | ratio | {'_int_mm':>8} | {'w8a8 op':>8} | ratio | "
          f"{'int4':>8} | {'w4a8':>8} | ratio")
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in LAYER_SHAPES}
        x32 = {k: v.float() for k, v in x.items()}
        q = {k: torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8) for _, k in LAYER_SHAPES}
        ways = {
            "packed": [lambda w=w, k=s[1]: torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")
                       for w, s in zip(packed, shapes)],
            "tiles": [lambda w=w, k=s[1]: ops.bf16_linear(x[k], w, None) for w, s in zip(arena.tiles, shapes)],
            # _int_mm needs more than 16 rows: fewer are padded, as the op itself never is.
            "int_mm": [lambda c=c, k=s[1]: torch._int_mm(q[k] if rows > 16 else torch.zeros(17, k, dtype=torch.int8),
                                                         c.t()) for c, s in zip(arena.codes, shapes)],
            "w8a8": [lambda c=c, sc=sc, k=s[1]: ops.w8a8_linear(x[k], c, sc, smooth_inv[k], None)
                     for c, sc, s in zip(arena.blocked, scales, shapes)],
            "int4": [lambda m=m, k=s[1]: ops.int4_linear(x32[k], m.packed, m.scales, m.mins, None)
                     for m, s in zip(arena.int4, shapes)] if rows <= 64 else None,
            "w4a8": [lambda m=m, k=s[1]: ops.w4a8_linear(x[k], m.blocked, None) for m, s in zip(arena.w4a8, shapes)],
        }
        ways = {name: matmuls for name, matmuls in ways.items() if matmuls is not None}
        repeats = args.repeats if rows <= 128 else max(3, args.repeats // 3)
        best = {name: float("inf") for name in ways}
        for _ in range(2):  # alternated: each way, then each way again
            for name, matmuls in ways.items():
                best[name] = min(best[name], step_ms(matmuls, repeats))
        best.setdefault("int4", float("nan"))
        print(f"{rows:5d} | {best['packed']:11.2f} | {best['tiles']:10.2f} | {best['packed'] / best['tiles']:4.2f}x | "
              f"{best['int_mm']:8.2f} | {best['w8a8']:8.2f} | {best['int_mm'] / best['w8a8']:4.2f}x | "
              f"{best['int4']:8.2f} | {best['w4a8']:8.2f} | {best['int4'] / best['w4a8']:4.2f}x")


if __name__ == "__main__":
    main()
