"""What the ``CustomOp`` dispatch (``layers/custom_op.py``) costs per call: each op called through
its dispatch against the same C++ op called directly, on decode-sized inputs (one row of
SmolLM2-135M), alternating the two in rounds; prints the per-call times and their ratio.

    python bench/custom_op_overhead.py [--calls 20000] [--rounds 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.layers import ops
from pagedllm.layers.custom_op import native_ops


def per_call_us(function, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    library = native_ops()
    if library is None:
        raise SystemExit("the C++ ops are not loaded: nothing to compare")
    hidden, intermediate = 576, 1536
    x, residual, weight = torch.randn(1, hidden), torch.randn(1, hidden), torch.ones(hidden)
    gate_up = torch.randn(1, 2 * intermediate)
    pairs = {
        "rms_norm": (lambda: ops.rms_norm(x, weight, 1e-5), lambda: library.rms_norm(x, weight, 1e-5)),
        "add_rms_norm_": (lambda: ops.add_rms_norm_(x, residual, weight, 1e-5),
                          lambda: library.add_rms_norm_(x, residual, weight, 1e-5)),
        "silu_and_mul": (lambda: ops.silu_and_mul(gate_up), lambda: library.silu_and_mul(gate_up)),
    }
    for dispatched, direct in pairs.values():
        dispatched(), direct()
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.calls} calls x {args.rounds} rounds "
          "(best round), dispatched vs direct alternating")
    for name, (dispatched, direct) in pairs.items():
        times: dict[str, list[float]] = {"dispatched": [], "direct": []}
        for _ in range(args.rounds):
            times["dispatched"].append(per_call_us(dispatched, args.calls))
            times["direct"].append(per_call_us(direct, args.calls))
        best = {key: min(values) for key, values in times.items()}
        print(f"{name:14s} dispatched {best['dispatched']:6.2f} us  direct {best['direct']:6.2f} us  "
              f"ratio {best['dispatched'] / best['direct']:.3f}  (+{best['dispatched'] - best['direct']:.2f} us)")


if __name__ == "__main__":
    main()
