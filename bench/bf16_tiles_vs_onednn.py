"""bf16 linear layers on this CPU: pagedllm's tiles (``bf16_linear``, ``csrc/quant_gemm.cpp``)
against oneDNN's packed matmul (``mkldnn::_linear_pointwise``, AMX tiles where the CPU has
AMX-BF16), at SmolLM2-1.7B layer shapes and 1 to 2,048 rows, and whether oneDNN's result for a
row is bitwise the same at every row count (the tiles' is).

Prints median milliseconds of alternated calls and oneDNN's time over the tiles' (below 1:
oneDNN is faster). ``layers/linear.py``'s ``amx_preferred`` rests on these ratios.

    .venv/bin/python bench/bf16_tiles_vs_onednn.py [--repeats 5]
"""

import argparse
import time

import torch

from pagedllm.layers.linear import bf16_linear, block_bf16
from pagedllm.layers.ops import native_ops
from pagedllm.platform import cpu_flags

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]  # (out_features, in_features)
ROWS = [1, 16, 64, 256, 2048]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit("the C++ ops are not loaded")
    print(f"amx_bf16: {'amx_bf16' in cpu_flags()}; threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    for n, k in SHAPES:
        weight = (torch.randn(n, k) * 0.02).bfloat16()
        blocked, packed = block_bf16(weight), torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        runs = {"tiles": lambda x: bf16_linear(x, blocked, None, False),
                "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        batch = torch.randn(max(ROWS), k).bfloat16()
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
            tiles, onednn = (sorted(times[n_])[len(times[n_]) // 2] * 1e3 for n_ in ("tiles", "onednn"))
            same = torch.equal(runs["onednn"](x), full[:rows])
            print(f"{n} x {k}, {rows} rows: tiles {tiles:.2f} ms, onednn {onednn:.2f} ms, onednn / tiles "
                  f"{onednn / tiles:.2f}; onednn rows bitwise those of {max(ROWS)} rows: {same}", flush=True)


if __name__ == "__main__":
    main()
