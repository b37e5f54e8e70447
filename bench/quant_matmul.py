"""Weight-only matmul on this CPU: fp32 ``F.linear`` vs torch's int8/int4 kernels (bf16
activations, as ``pagedllm/layers/quantization.py`` calls them) vs dequantize-then-matmul,
for SmolLM2/Qwen2 layer shapes and row counts from decode (1) to prefill chunks (256).

Prints milliseconds (best of ``--repeats``) and each method's ratio to fp32 in the same run.
``python bench/quant_matmul.py [--threads N] [--repeats R]``
"""

import argparse
import time

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization import Int4Linear, Int8Linear


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n, k in [(3072, 576), (576, 1536), (9728, 896)]:
        weight = torch.randn(n, k) * 0.05
        int8, int4 = Int8Linear.from_float(weight, None), Int4Linear.from_float(weight, None)
        for rows in (1, 4, 16, 64, 256):
            x = torch.randn(rows, k)
            fp32 = best_ms(lambda: F.linear(x, weight), args.repeats)
            results = {
                "int8 kernel": best_ms(lambda: torch.ops.aten._weight_int8pack_mm(
                    x.bfloat16(), int8.codes, int8.scales_bf16).float(), args.repeats),
                "int8 dequant": best_ms(lambda: F.linear(x, int8.dequantize()), args.repeats),
                "int4 kernel": best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.bfloat16(), int4.packed, 32, int4.scales_and_zeros).float(), args.repeats),
                "int4 dequant": best_ms(lambda: F.linear(x, int4.dequantize()), args.repeats),
            }
            line = "  ".join(f"{name} {ms:7.3f} ({ms / fp32:5.2f}x)" for name, ms in results.items())
            print(f"N={n:5d} K={k:5d} rows={rows:3d}  fp32 {fp32:7.3f} ms  {line}", flush=True)


if __name__ == "__main__":
    main()
