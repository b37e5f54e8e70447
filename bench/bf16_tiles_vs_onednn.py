"""bf16 (``--dtype float32``: fp32) linear layers on this CPU: pagedllm's tiles (``bf16_linear`` /
``fp32_linear``, ``csrc/quant_gemm.cpp``) against oneDNN's packed matmul
(``mkldnn::_linear_pointwise``, AMX tiles where the CPU has AMX-BF16) and, in fp32, MKL's
``torch.mm``, at SmolLM2-1.7B layer shapes and 1 to 2,048 rows, and whether oneDNN's result for
a row is bitwise the same at every row count (the tiles' is).

Prints median milliseconds of alternated calls and each peer's time over the tiles' (below 1:
the peer is faster). ``layers/linear.py``'s ``amx_preferred`` and ``Linear.pack`` rest on these
ratios.

    .venv/bin/python bench/bf16_tiles_vs_onednn.py [--repeats 5] [--dtype float32]
"""

import argparse
import time

import torch

from pagedllm.layers.linear import bf16_linear, block_bf16, block_fp32, fp32_linear
from pagedllm.layers.ops import native_ops
from pagedllm.platform import cpu_flags

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # (out_features, in_features)
ROWS = [1, 16, 64, 256, 2048]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if native_ops() is None:
        raise SystemExit("the C++ ops are not loaded")
    print(f"amx_bf16: {'amx_bf16' in cpu_flags()}; threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k) * 0.02).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        if dtype == torch.bfloat16:
            blocked = block_bf16(weight)
            runs = {"tiles": lambda x: bf16_linear(x, blocked, None, False)}
        else:
            blocked, weight_t = block_fp32(weight), weight.t().contiguous()
            runs = {"tiles": lambda x: fp32_linear(x, blocked, None), "mkl": lambda x: torch.mm(x, weight_t)}
        runs["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        batch = torch.randn(max(ROWS), k).to(dtype)
        full = runs["onednn"](batch)
        for rows in ROWS:
            x = batch[:rows]
            times = {name: [] for name in runs}
            for fn in runs.values():
                fn(x)
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    start = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - start)
            ms = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
            same = torch.equal(runs["onednn"](x), full[:rows])
            peers = ", ".join(f"{name} {ms[name]:.2f} ms ({ms[name] / ms['tiles']:.2f})" for name in runs if name != "tiles")
            print(f"{n} x {k}, {rows} rows: tiles {ms['tiles']:.2f} ms, {peers}; onednn rows bitwise those of "
                  f"{max(ROWS)} rows: {same}", flush=True)


if __name__ == "__main__":
    main()
