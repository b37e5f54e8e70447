"""Single-stream decode of one model under each ISA build of the C++ ops (``PAGEDLLM_ISA``), per
quantization, each run in a fresh process, the variants alternated ``--repeats`` times.

    .venv/bin/python bench/isa_variants.py [--variants avx2 avx512_bf16] [--configs none int8 int4 w8a8 w4a8]
        [--dtype float32] [--repeats 2] [--checkout DIR]

A run prints its decode tokens/s (after the first token; 256-token prompt of the shipped text,
128 new tokens, greedy, EOS ignored) and, per alternation, the ratio of each variant to the
first one of the list. ``--checkout`` runs another checkout's build of the same variants
beside this one (its own ``pagedllm`` package and libraries; the same venv's torch): the way
to compare a kernel change old against new in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(config: str, dtype: str) -> None:
    """One single-stream run in this process; prints RESULT."""
    from pagedllm import LLM
    from pagedllm.benchmarks.throughput import TEXT_PATH, single_stream_pagedllm
    from pagedllm.layers.ops import native_ops

    llm = LLM(dtype=dtype, quantization=None if config == "none" else config, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 28, max_model_len=512)
    tokens = llm.get_tokenizer().encode(TEXT_PATH.read_text(), add_special_tokens=False)
    single_stream_pagedllm(llm, tokens[1000:1016], 4)
    _, rate = single_stream_pagedllm(llm, tokens[:256], 128)
    print("RESULT " + json.dumps({"build": native_ops().build_info().split()[0], "tokens_per_s": round(rate, 2)}))


def run(checkout: Path, variant: str, config: str, dtype: str) -> float:
    env = dict(os.environ, PAGEDLLM_ISA=variant, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "isa_variants.py"), "--worker", config, dtype],
                         capture_output=True, text=True, env=env, cwd=checkout, timeout=1800)
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{variant} {config} failed: {out.stderr[-2000:]}")
    result = json.loads(line[7:])
    assert result["build"] == variant, result
    return result["tokens_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["avx2", "avx512_bf16"])
    parser.add_argument("--configs", nargs="+", default=["none", "int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkout", type=Path, help="another checkout to run beside this one")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    systems = [(ROOT, v) for v in args.variants]
    if args.checkout:
        systems = [(c, v) for v in args.variants for c in (args.checkout.resolve(), ROOT)]
    for config in args.configs:
        for repeat in range(args.repeats):
            rates = [run(checkout, variant, config, args.dtype) for checkout, variant in systems]
            cells = [f"{'' if c == ROOT else c.name + ':'}{v} {r:.1f}" for (c, v), r in zip(systems, rates)]
            ratios = " ".join(f"{r / rates[0]:.2f}x" for r in rates[1:])
            print(f"{config:6s} {args.dtype} run {repeat + 1}: " + ", ".join(cells) + f"  (ratio to the first: {ratios})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
