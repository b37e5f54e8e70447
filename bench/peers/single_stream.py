"""Single-stream decode, pagedllm (unquantized, int8, int4, w8a8, w4a8) against llama.cpp on a bf16 GGUF of
the same weights, each run in a fresh process, alternated ``--repeats`` times.

    .venv/bin/python bench/peers/single_stream.py [--repeats 2] [--model NAME] [--llama-venv V]
        [--gguf F [F ...]] [--configs none int8 int4 int4:bf16kv w4a8:int8kv ...] [--dtype auto]

Prompt: the first 256 tokens of the shipped text (pagedllm's tokenizer), 128 new tokens,
greedy, EOS ignored; decode speed is the rate after the first token on both sides. pagedllm
runs with prefix caching off; a configuration is a quantization, with ``:bf16kv`` for
``kv_cache_dtype="bfloat16"`` and ``:int8kv`` for ``kv_cache_dtype="int8"``. Each run also reports its weight bytes and the KV blocks that a
1 GiB budget for weights + KV leaves room for; each alternation prints pagedllm's ratios to
the reference run just before or after it. Needs ``setup_llama_cpp.sh``'s venv and GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from compare import run_one

from pagedllm import envs

HERE = Path(__file__).resolve().parent
BUDGET = 1 << 30
CONFIGS = ["none", "int8", "int4", "w8a8", "w4a8"]
CONFIGS += [f"{q}:{kv}" for kv in ("bf16kv", "int8kv") for q in CONFIGS]
KV_CACHE_DTYPES = {"": "auto", "bf16kv": "bfloat16", "int8kv": "int8"}


def pagedllm_worker(prompt_path: str, config: str, model: str, dtype: str) -> None:
    """One pagedllm single-stream run (in its own process); prints RESULT."""
    from pagedllm import LLM
    from pagedllm.benchmarks.throughput import single_stream_pagedllm

    data = json.loads(Path(prompt_path).read_text())
    quantization, _, kv = config.partition(":")
    start = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, quantization=None if quantization == "none" else quantization,
              kv_cache_dtype=KV_CACHE_DTYPES[kv],
              enable_prefix_caching=False, kv_cache_memory_bytes=BUDGET)
    startup_s = time.perf_counter() - start
    engine = llm.llm_engine
    single_stream_pagedllm(llm, data["warmup_token_ids"], 4)
    ttft, rate = single_stream_pagedllm(llm, data["prompt_token_ids"], data["new_tokens"])
    print("RESULT " + json.dumps({
        "system": f"pagedllm {config}", "startup_s": round(startup_s, 1),
        "single_stream_ttft_s": round(ttft, 4), "single_stream_decode_tokens_per_s": round(rate, 2),
        "weight_bytes": engine.weight_bytes,
        "kv_blocks": max(0, (BUDGET - engine.weight_bytes) // engine.bytes_per_block),
        "dtype": str(engine.model.dtype)}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    peers_dir = str(envs.PAGEDLLM_PEERS_DIR)  # the peers' venvs, models and logs
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-venv", default=os.path.join(peers_dir, "llama-venv"))
    parser.add_argument("--model", default="smollm2-135m", help="pagedllm model (default smollm2-135m)")
    parser.add_argument("--gguf", nargs="+", default=[os.path.join(peers_dir, "smollm2-bf16.gguf")],
                        help="GGUF files for llama.cpp, the first one the reference (a bf16 conversion)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS,
                        help="pagedllm quantizations to run (default all)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="pagedllm's compute dtype (default auto: bfloat16 where the CPU has bf16 units)")
    parser.add_argument("--workdir", default=peers_dir)
    parser.add_argument("--worker", nargs=4, metavar=("PROMPT_JSON", "CONFIG", "MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        pagedllm_worker(*args.worker)
        return 0

    from pagedllm.benchmarks.throughput import TEXT_PATH
    from pagedllm.models.loader import load_tokenizer, resolve_model_path

    tokens = load_tokenizer(resolve_model_path(args.model)).encode(TEXT_PATH.read_text(), add_special_tokens=False)
    workdir = Path(args.workdir)
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    prompt_path = workdir / "single_stream_prompt.json"
    prompt_path.write_text(json.dumps({"prompt_token_ids": tokens[:256], "warmup_token_ids": tokens[256:272],
                                       "new_tokens": 128}))
    commands = {q: [sys.executable, str(Path(__file__).resolve()), "--worker", str(prompt_path), q, args.model,
                    args.dtype]
                for q in args.configs}
    for gguf in args.gguf:
        commands[gguf] = [str(Path(args.llama_venv) / "bin" / "python"), str(HERE / "llama_cpp_single_stream.py"),
                          "--gguf", gguf, "--prompt-json", str(prompt_path)]
    reference = args.gguf[0]
    print(f"machine: {os.cpu_count()} CPUs; {args.model}, dtype {args.dtype}; prompt 256 tokens, 128 new, greedy; "
          f"llama.cpp on {', '.join(args.gguf)}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for index in range(args.repeats):
        for name, cmd in commands.items():
            r = run_one(cmd, dict(os.environ), workdir / "logs" / f"{stamp}_{index + 1}_ss_{Path(name).name}.log", 1800)
            runs[name].append(r)
            extra = f", {r['kv_blocks']} KV blocks" if "kv_blocks" in r else ""
            name_shown = f"{r['system']} {r.get('gguf', '')}".strip()
            print(f"{name_shown:>60} #{index + 1}: TTFT {r['single_stream_ttft_s'] * 1000:6.0f} ms, decode "
                  f"{r['single_stream_decode_tokens_per_s']:6.1f} tokens/s   (weights {r['weight_bytes'] / 2**20:.0f} MiB"
                  f"{extra}, start-up {r['startup_s']} s)", flush=True)
        pairs = ", ".join(f"{name} {runs[name][-1]['single_stream_decode_tokens_per_s'] / runs[reference][-1]['single_stream_decode_tokens_per_s']:.2f}x"
                          for name in args.configs)
        print(f"{'':>60} #{index + 1}: {pairs}", flush=True)
    med = {name: statistics.median(r["single_stream_decode_tokens_per_s"] for r in rs) for name, rs in runs.items()}
    print()
    for name in list(commands):
        shown = f"pagedllm {name}" if name in CONFIGS else f"llama.cpp {Path(name).name}"
        print(f"median decode {shown}: {med[name]:.1f} tokens/s = {med[name] / med[reference]:.2f}x "
              f"llama.cpp on {Path(reference).name} ({med[reference]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
