"""One mixture-of-experts layer on this CPU: the fused experts path (``layers/fused_moe.py:
fused_experts``: a step's tokens sorted by expert, one GEMM pair per active expert, weighted
scatter-add) against the per-token loop (``experts_per_token``: ``batch x top_k`` one-row
products), routing included in both.

Default shape: a Qwen3-30B-A3B layer (hidden 2048, 128 experts, top 8, expert intermediate
size 768; 1.2 GB of bf16 expert weights, random), at batch 1 (decode of one sequence) and 64
(a decode batch, or a prefill chunk). The two systems alternate within each repeat; prints the
best time of each, tokens/s, and fused/per-token throughput ratio (above 1: fused faster).

``python bench/moe.py [--dtype bfloat16|float32] [--batch 1 64] [--repeats 5] [--threads N]``;
smoke test: ``--hidden 64 --experts 8 --top-k 2 --intermediate 32 --repeats 1``.
"""

import argparse
import time

import torch
from torch import nn

from pagedllm.layers.fused_moe import Expert, experts_per_token, fused_experts, route
from pagedllm.layers.linear import Linear


def build_layer(hidden: int, experts: int, intermediate: int, dtype: torch.dtype) -> tuple[Linear, nn.ModuleList]:
    """A router and ``experts`` SwiGLU experts with random weights, packed as the engine packs them."""
    generator = torch.Generator().manual_seed(0)
    router = Linear(hidden, experts)
    router.set_weight(torch.randn(experts, hidden, generator=generator) * 0.05, dtype)
    layer = nn.ModuleList()
    for _ in range(experts):
        expert = Expert(hidden, intermediate)
        expert.gate_up_proj.set_weight(torch.randn(2 * intermediate, hidden, generator=generator) * 0.02, dtype)
        expert.down_proj.set_weight(torch.randn(hidden, intermediate, generator=generator) * 0.02, dtype)
        expert.gate_up_proj.pack()
        expert.down_proj.pack()
        layer.append(expert)
    router.pack()
    return router, layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    router, experts = build_layer(args.hidden, args.experts, args.intermediate, dtype)
    systems = {"fused": fused_experts, "per-token": experts_per_token}
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts, top {args.top_k}, intermediate "
          f"{args.intermediate}, {args.dtype}, {args.threads} threads")
    with torch.inference_mode():
        for batch in args.batch:
            x = torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
            best = {name: float("inf") for name in systems}
            for _ in range(args.repeats + 1):  # the first round warms up and is not counted
                for name, combine in systems.items():
                    start = time.perf_counter()
                    weights, expert_ids = route(router(x), args.top_k, normalize=True)
                    combine(x, experts, weights, expert_ids)
                    elapsed = time.perf_counter() - start
                    if _ > 0 or args.repeats == 0:
                        best[name] = min(best[name], elapsed)
            fused, loop = best["fused"], best["per-token"]
            print(f"batch {batch:4d}: fused {fused * 1e3:8.2f} ms ({batch / fused:9.1f} tokens/s), per-token "
                  f"{loop * 1e3:8.2f} ms ({batch / loop:9.1f} tokens/s), fused/per-token throughput "
                  f"{loop / fused:.2f}x")


if __name__ == "__main__":
    main()
