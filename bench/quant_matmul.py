"""Quantized matmul on this CPU: fp32 ``torch.mm`` (the ``[in, out]`` layout ``Linear`` uses)
against pagedllm's own int8/int4 kernels (``csrc/quant_gemm.cpp``, fp32 activations), torch's
int8 weight-only kernel (bf16 activations), dequantize-then-matmul, the packed bf16 GEMM that
``dtype=bfloat16`` runs (``Linear.pack``) and W8A8 (``csrc/w8a8.cpp``: per-token int8
activations times int8 codes blocked for VPDPBUSD; bf16 input), for SmolLM2/Qwen2 layer shapes and row counts
from decode (1) to prefill chunks (2048).

Prints milliseconds (best of ``--repeats``) and each method's time relative to fp32 in the same
run (below 1 is faster). ``.venv/bin/python bench/quant_matmul.py [--threads N] [--repeats R]``
"""

import argparse
import time

import torch

from pagedllm.layers.ops import native_ops
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization import Int4Linear, Int8Linear, W8A8Linear


def best_ms(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = native_ops()
    for n, k in [(960, 576), (3072, 576), (576, 1536), (9728, 896)]:
        weight = torch.randn(n, k) * 0.05
        weight_t = weight.t().contiguous()
        int8, int4 = Int8Linear.from_float(weight, None), Int4Linear.from_float(weight, None)
        w8a8 = W8A8Linear.from_float(weight, None)
        bf16 = Linear(k, n)
        bf16.set_weight(weight, torch.bfloat16)
        bf16.pack()
        for rows in args.rows:
            x = torch.randn(rows, k)
            x_bf16 = x.bfloat16()
            fp32 = best_ms(lambda: torch.mm(x, weight_t), args.repeats)
            results = {
                "int8 own": best_ms(lambda: ops.int8_linear(x, int8.codes, int8.scales, None), args.repeats),
                "int4 own": best_ms(lambda: ops.int4_linear(x, int4.packed, int4.scales, int4.mins, None),
                                    args.repeats),
                "int8 torch": best_ms(lambda: torch.ops.aten._weight_int8pack_mm(
                    x.bfloat16(), int8.codes, int8.scales.bfloat16()).float(), args.repeats),
                "int8 dequant": best_ms(lambda: torch.mm(x, int8.dequantize().t()), args.repeats),
                "bf16 packed": best_ms(lambda: bf16(x_bf16), args.repeats),
                "w8a8": best_ms(lambda: w8a8(x_bf16), args.repeats),
            }
            line = "  ".join(f"{name} {ms:7.3f} ({ms / fp32:5.2f}x)" for name, ms in results.items())
            print(f"N={n:5d} K={k:5d} rows={rows:3d}  fp32 {fp32:7.3f} ms  {line}", flush=True)


if __name__ == "__main__":
    main()
