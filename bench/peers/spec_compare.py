"""Speculative decoding, single stream: pagedllm (no speculation, ``ngram``, ``suffix``) against
llama.cpp (plain and with prompt-lookup decoding) on bench/spec_decode.py's workloads, each run in a
fresh process, alternated round after round.

    .venv/bin/python bench/peers/spec_compare.py [--rounds 3] [--max-tokens N]
        [--workloads code-edit summary] [--configs none ngram suffix] [--llama-prompt-lookup 5 10]
        [--gguf code-edit=FILE --gguf summary=FILE ...] [--threads N]
        [--dtype auto] [--quantization int8|int4|...] [--kv-cache-dtype auto]

Prompts: ``spec_decode.WORKLOADS`` through ``spec_decode.build_prompt`` (pagedllm's tokenizer of
the workload's model), written as token ids to a JSON file, so both systems decode the same ids.
Both: greedy, ``--threads`` threads, a 4-token warm-up on the same prompt, decode tokens/s from
the first token to the last (prefill left out), EOS ignored for ``--max-tokens`` tokens; by default
(0) that is the length of pagedllm's non-speculative answer to its EOS, measured by one extra run
first, so that every system decodes as many tokens as the answer has.

- pagedllm: ``spec_decode.run_once`` on an ``LLMEngine`` with ``spec_decode.CONFIGS[config]``
  (``--num-speculative-tokens``, ``--prompt-lookup-min`` as there) and ``--dtype`` /
  ``--quantization`` / ``--kv-cache-dtype`` (default: what bench/spec_decode.py runs).
- llama.cpp (``llama_cpp_spec.py`` in ``--llama-venv``): each ``--gguf`` of the workload, plain and
  with ``LlamaPromptLookupDecoding(num_pred_tokens=K)`` for each ``--llama-prompt-lookup`` K.
  Default GGUFs: code-edit the Qwen2.5-Coder Q4_K_M file pagedllm's model was converted from;
  summary ``$PAGEDLLM_PEERS_DIR/smollm2-bf16.gguf`` and ``smollm2-q8_0.gguf`` (setup_llama_cpp.sh's
  conversions of export_hf.py's folder: the shipped Q4_1 file crashes llama.cpp).

Prints every run, then per workload the medians, the ratio to pagedllm without speculation and
to llama.cpp's best configuration, and how far each output agrees with pagedllm's
non-speculative one: pagedllm's must be equal (greedy speculation is exact); llama.cpp's weights
are quantized differently, so its common-prefix length is reported instead.
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
sys.path.insert(0, str(HERE.parent))  # bench/spec_decode.py
import spec_decode  # noqa: E402

SPEC_CONFIGS = list(spec_decode.CONFIGS)


def pagedllm_worker(prompt_path: str, options_json: str) -> None:
    """One pagedllm run in its own process: warm-up, then one timed greedy generation; prints RESULT."""
    import torch

    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    options = json.loads(options_json)
    torch.set_num_threads(options["threads"])
    prompt = json.loads(Path(prompt_path).read_text())["prompt_token_ids"]
    start = time.perf_counter()
    engine = LLMEngine(EngineArgs.from_kwargs(
        model=options["model"], dtype=options["dtype"], quantization=options["quantization"],
        kv_cache_dtype=options["kv_cache_dtype"], kv_cache_memory_bytes=256 * 2**20, max_model_len=2048,
        speculative_config=options["speculative_config"]))
    startup_s = time.perf_counter() - start
    spec_decode.run_once(engine, prompt, 4)
    if options["max_tokens"]:
        result = spec_decode.run_once(engine, prompt, options["max_tokens"])
    else:  # the answer, to its EOS
        result = spec_decode.run_once(engine, prompt, 1024, ignore_eos=False)
    print("RESULT " + json.dumps({
        "system": "pagedllm", "startup_s": round(startup_s, 1), "threads": torch.get_num_threads(),
        "dtype": str(engine.model.dtype), "prompt_tokens": len(prompt), "num_tokens": len(result["tokens"]),
        "tok_s": round(result["tok_s"], 2), "tokens_per_step": round(result["tokens_per_step"], 3),
        "acceptance": result["acceptance"], "token_ids": list(result["tokens"])}), flush=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def default_ggufs(peers_dir: Path) -> dict[str, list[str]]:
    cache = envs.PAGEDLLM_CACHE_DIR
    summary = [str(peers_dir / f"smollm2-{kind}.gguf") for kind in ("bf16", "q8_0")]
    return {"code-edit": [str(cache / "gguf" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")],
            "summary": [p for p in summary if os.path.exists(p)] or summary[:1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peers_dir = envs.PAGEDLLM_PEERS_DIR
    parser.add_argument("--workloads", nargs="+", choices=sorted(spec_decode.WORKLOADS),
                        default=["code-edit", "summary"])
    parser.add_argument("--configs", nargs="+", choices=SPEC_CONFIGS, default=["none", "ngram", "suffix"],
                        help="pagedllm configurations; 'none' always runs (the reference)")
    parser.add_argument("--llama-prompt-lookup", nargs="*", type=int, default=[5, 10], metavar="K",
                        help="llama.cpp prompt-lookup num_pred_tokens values, each beside a plain run")
    parser.add_argument("--max-ngram-size", type=int, default=2, help="LlamaPromptLookupDecoding's (default 2)")
    parser.add_argument("--gguf", action="append", default=[], metavar="WORKLOAD=FILE",
                        help="llama.cpp GGUF for a workload (repeatable; replaces that workload's defaults)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="tokens decoded per run; 0 (default): pagedllm's greedy answer's length, to its EOS")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="both systems (default: all CPUs)")
    parser.add_argument("--dtype", default="auto", help="pagedllm")
    parser.add_argument("--quantization", default=None, help="pagedllm (e.g. int8, int4)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="pagedllm")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="pagedllm ngram and draft_model: default 5; suffix: default the trie's depth (vLLM's rule)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="pagedllm ngram (prompt_lookup_max: 5 or this)")
    parser.add_argument("--llama-venv", default=str(peers_dir / "llama-venv"))
    parser.add_argument("--workdir", default=str(peers_dir), help="prompt JSON files and per-run logs go here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--worker", nargs=2, metavar=("PROMPT_JSON", "OPTIONS_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        pagedllm_worker(*args.worker)
        return 0
    if args.max_tokens == 1 or args.max_tokens < 0:
        parser.error(f"--max-tokens must be 0 or >= 2 (a decode rate needs two tokens), got {args.max_tokens}")

    ggufs = default_ggufs(peers_dir)
    given: dict[str, list[str]] = {}
    for item in args.gguf:
        workload, sep, path = item.partition("=")
        if not sep or workload not in spec_decode.WORKLOADS:
            parser.error(f"--gguf takes WORKLOAD=FILE with WORKLOAD in {sorted(spec_decode.WORKLOADS)}, got {item!r}")
        given.setdefault(workload, []).append(path)
    ggufs.update(given)
    for workload in args.workloads:
        for path in ggufs[workload]:
            if not os.path.exists(path):
                parser.error(f"{workload}: GGUF {path} does not exist (see bench/peers/README.md, setup_llama_cpp.sh)")
    llama_python = Path(args.llama_venv) / "bin" / "python"
    if not llama_python.exists():
        parser.error(f"no llama-cpp-python venv at {args.llama_venv} (bench/peers/setup_llama_cpp.sh)")

    spec_configs = {name: dict(config) if config else None for name, config in spec_decode.CONFIGS.items()}
    k = args.num_speculative_tokens
    spec_configs["ngram"].update(num_speculative_tokens=k or 5, prompt_lookup_min=args.prompt_lookup_min,
                                 prompt_lookup_max=max(5, args.prompt_lookup_min))
    spec_configs["draft_model"].update(num_speculative_tokens=k or 5)
    if k:
        spec_configs["suffix"].update(num_speculative_tokens=k)
    configs = ["none"] + [c for c in args.configs if c != "none"]

    from pagedllm.models.loader import load_tokenizer, resolve_model_path

    workdir = Path(args.workdir)
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"machine: {os.cpu_count()} CPUs, {args.threads} threads each; greedy, "
          f"{args.max_tokens or 'the answer'} tokens; pagedllm dtype {args.dtype}, quantization {args.quantization}, kv {args.kv_cache_dtype}; "
          f"{args.rounds} alternated rounds of fresh processes", flush=True)
    tables = []
    for workload in args.workloads:
        model, text = spec_decode.WORKLOADS[workload]
        prompt = spec_decode.build_prompt(load_tokenizer(resolve_model_path(model)), text)
        prompt_path = workdir / f"spec_compare_{workload}.json"
        prompt_path.write_text(json.dumps({"prompt_token_ids": prompt}))
        max_tokens = args.max_tokens
        base_options = {"model": model, "dtype": args.dtype, "quantization": args.quantization,
                        "kv_cache_dtype": args.kv_cache_dtype, "threads": args.threads}
        if not max_tokens:
            options = dict(base_options, max_tokens=0, speculative_config=None)
            answer = run_one([sys.executable, str(Path(__file__).resolve()), "--worker", str(prompt_path),
                              json.dumps(options)], dict(os.environ),
                             workdir / "logs" / f"{stamp}_spec_{workload}_answer.log", args.timeout)
            max_tokens = answer["num_tokens"]
        commands: dict[str, list[str]] = {}
        for config in configs:
            options = dict(base_options, max_tokens=max_tokens, speculative_config=spec_configs[config])
            if config == "draft_model":  # as bench/spec_decode.py's default: the model drafts for itself as int4
                options["speculative_config"] = dict(spec_configs[config], model=model, quantization="int4")
            commands[f"pagedllm {config}"] = [sys.executable, str(Path(__file__).resolve()), "--worker",
                                              str(prompt_path), json.dumps(options)]
        for gguf in ggufs[workload]:
            for k in [0] + args.llama_prompt_lookup:
                name = f"llama.cpp {Path(gguf).name}" + (f" lookup {k}" if k else "")
                commands[name] = [str(llama_python), str(HERE / "llama_cpp_spec.py"), "--gguf", gguf,
                                  "--prompt-json", str(prompt_path), "--max-tokens", str(max_tokens),
                                  "--threads", str(args.threads), "--prompt-lookup", str(k),
                                  "--max-ngram-size", str(args.max_ngram_size)]
        print(f"\n## {workload}: {model}, {len(prompt)}-token prompt, {max_tokens} tokens", flush=True)
        runs: dict[str, list[dict]] = {name: [] for name in commands}
        width = max(len(name) for name in commands)
        for index in range(args.rounds):
            for name, cmd in commands.items():
                load = float(Path("/proc/loadavg").read_text().split()[0])
                log = workdir / "logs" / f"{stamp}_spec_{workload}_{index + 1}_{name.replace(' ', '_')}.log"
                r = run_one(cmd, dict(os.environ), log, args.timeout)
                runs[name].append(r)
                extra = f", {r['tokens_per_step']:.2f} tokens/step" if "tokens_per_step" in r else ""
                if r.get("acceptance", float("nan")) == r.get("acceptance"):  # NaN: nothing drafted
                    extra += f", acceptance {r['acceptance']:.2f}"
                print(f"{name:>{width}} #{index + 1}: {r['tok_s']:7.1f} tok/s{extra}   (start-up {r['startup_s']} s, "
                      f"load avg {load:.1f})", flush=True)
        reference = runs["pagedllm none"][0]["token_ids"]
        med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
        llama_names = [name for name in runs if name.startswith("llama.cpp")]
        best_llama = max(llama_names, key=med.get)
        lines = [f"\n## {workload}: {model}, {len(prompt)}-token prompt, {max_tokens} tokens, greedy, "
                 f"median of {args.rounds} alternated rounds; llama.cpp's best: {best_llama}",
                 "| system | decode tok/s | vs pagedllm none | vs llama.cpp best | tokens/step | acceptance "
                 "| output vs pagedllm none |", "|---|---|---|---|---|---|---|"]
        for name, rs in runs.items():
            prefixes = [common_prefix(r["token_ids"], reference) for r in rs]
            agree = (str(all(r["token_ids"] == reference for r in rs)) if name.startswith("pagedllm")
                     else f"common prefix {min(prefixes)}/{len(reference)}")
            steps = "- | -"
            if "tokens_per_step" in rs[0]:
                acceptance = [r["acceptance"] for r in rs if r["acceptance"] == r["acceptance"]]  # NaN: no drafts
                steps = (f"{statistics.median(r['tokens_per_step'] for r in rs):.2f} | "
                         + (f"{statistics.median(acceptance):.2f}" if acceptance else "-"))
            lines.append(f"| {name} | {med[name]:.1f} | {med[name] / med['pagedllm none']:.2f}x | "
                         f"{med[name] / med[best_llama]:.2f}x | {steps} | {agree} |")
        print("\n".join(lines), flush=True)
        tables.append("\n".join(lines))
    print("\n# summary\n" + "\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
